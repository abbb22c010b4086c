//! What the SQL stores share, whichever client runs them: the statements, and the advisory
//! lock ids of the PostgreSQL stores.
#![cfg_attr(
    not(all(
        feature = "sqlite",
        feature = "postgres",
        feature = "sqlx-sqlite",
        feature = "sqlx-postgres"
    )),
    allow(dead_code)
)]

/// SQLite's table, created if missing. Exactly two numbers per (name, key, shard); `has_key`
/// tells no key from the empty key without relying on NULL in a primary key.
pub(crate) const SQLITE_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS tollgate_state (
    name    TEXT    NOT NULL,
    has_key INTEGER NOT NULL,
    key     TEXT    NOT NULL,
    shard   INTEGER NOT NULL,
    value   REAL    NOT NULL,
    ts      REAL    NOT NULL,
    PRIMARY KEY (name, has_key, key, shard)
) WITHOUT ROWID;
";

/// SQLite: one slot's state.
pub(crate) const SQLITE_SELECT: &str = "SELECT value, ts FROM tollgate_state \
    WHERE name = ?1 AND has_key = ?2 AND key = ?3 AND shard = ?4";
/// SQLite: saves one slot's state.
pub(crate) const SQLITE_UPSERT: &str = "INSERT INTO tollgate_state (name, has_key, key, shard, value, ts) \
    VALUES (?1, ?2, ?3, ?4, ?5, ?6) \
    ON CONFLICT (name, has_key, key, shard) DO UPDATE SET value = excluded.value, ts = excluded.ts";
/// SQLite: deletes one slot's state (it is full again).
pub(crate) const SQLITE_DELETE: &str =
    "DELETE FROM tollgate_state WHERE name = ?1 AND has_key = ?2 AND key = ?3 AND shard = ?4";
/// SQLite: deletes the first ?4 shards of (name, key).
pub(crate) const SQLITE_DELETE_ALL: &str =
    "DELETE FROM tollgate_state WHERE name = ?1 AND has_key = ?2 AND key = ?3 AND shard < ?4";

/// The class of tollgate's advisory locks (`'toll'`), so they never meet an app's own.
pub(crate) const LOCK_CLASS: i32 = 0x746f_6c6c;

/// A stable 32-bit id of a slot for its advisory lock: FNV-1a, the same in every process and
/// build (std's hashers promise neither). A collision only makes two slots wait for each other.
pub(crate) fn lock_id(name: &str, key: Option<&str>, shard: u16) -> i32 {
    let mut h: u32 = 0x811c_9dc5;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h = (h ^ u32::from(b)).wrapping_mul(0x0100_0193);
        }
    };
    eat(name.as_bytes());
    match key {
        Some(key) => {
            eat(&[0xff]);
            eat(key.as_bytes());
        }
        None => eat(&[0xfe]),
    }
    eat(&shard.to_le_bytes());
    h as i32
}

/// The distinct lock ids of `slots`, ascending: the order every request takes them in, so
/// two requests never wait for each other in a cycle.
pub(crate) fn lock_ids(slots: &[tollgate_core::Slot<'_>]) -> Vec<i32> {
    let mut ids: Vec<i32> = slots.iter().map(|s| lock_id(s.name, s.key, s.shard)).collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// Whether `table` is a name that may go into a statement as it is.
pub(crate) fn valid_table(table: &str) -> bool {
    !table.is_empty() && table.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// PostgreSQL's statements, for one table.
pub(crate) struct PgSql {
    pub(crate) create: String,
    pub(crate) load: String,
    pub(crate) upsert: String,
    pub(crate) delete: String,
    pub(crate) delete_all: String,
}

impl PgSql {
    pub(crate) fn new(table: &str) -> Self {
        PgSql {
            create: format!(
                "CREATE TABLE IF NOT EXISTS {table} (
                    name text NOT NULL, has_key boolean NOT NULL, key text NOT NULL,
                    shard integer NOT NULL, value double precision NOT NULL,
                    ts double precision NOT NULL, PRIMARY KEY (name, has_key, key, shard))"
            ),
            // One row per slot, in order, with the database's time once the locks are held.
            load: format!(
                "SELECT s.i, t.value, t.ts, (extract(epoch FROM clock_timestamp()) * 1000)::float8
                 FROM unnest($1::text[], $2::bool[], $3::text[], $4::int4[])
                      WITH ORDINALITY AS s(name, has_key, key, shard, i)
                 LEFT JOIN {table} t USING (name, has_key, key, shard)
                 ORDER BY s.i"
            ),
            upsert: format!(
                "INSERT INTO {table} (name, has_key, key, shard, value, ts) VALUES ($1, $2, $3, $4, $5, $6)
                 ON CONFLICT (name, has_key, key, shard) DO UPDATE SET value = excluded.value, ts = excluded.ts"
            ),
            delete: format!("DELETE FROM {table} WHERE name = $1 AND has_key = $2 AND key = $3 AND shard = $4"),
            delete_all: format!("DELETE FROM {table} WHERE name = $1 AND has_key = $2 AND key = $3 AND shard < $4"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_ids_are_stable_and_tell_keys_apart() {
        assert_eq!(lock_id("send", Some("alice"), 0), lock_id("send", Some("alice"), 0));
        assert_ne!(lock_id("send", None, 0), lock_id("send", Some(""), 0));
        assert_ne!(lock_id("send", Some("alice"), 0), lock_id("send", Some("alice"), 1));
        // Fixed, whatever the build: the same id in every app server.
        assert_eq!(lock_id("", None, 0), 1_649_693_001); // FNV-1a of fe 00 00
    }

    #[test]
    fn table_names_are_checked() {
        assert!(valid_table("tollgate_state2"));
        assert!(!valid_table("x; DROP TABLE y"));
        assert!(!valid_table(""));
    }
}
