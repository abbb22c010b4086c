//! The Redis protocol's wire format, as a server sees it: commands in (a RESP array of bulk
//! strings, or an inline line of words), replies out (RESP2, or RESP3 after `HELLO 3`).
//!
//! Written here rather than taken from a crate: a server reads one shape only (an array of
//! bulk strings, the rare inline line), and reads it best as ranges of the bytes already
//! received, checked against tollgate's bounds before anything is allocated.
//! `redis-protocol` (the crate that fits best) decodes every RESP type into a frame per
//! argument, for clients, and has no inline commands.

use std::ops::Range;

/// The most arguments one command may have (the command's name included).
pub const MAX_ARGS: usize = 4_096;

/// The most bytes one command's arguments may take together: as large as an HTTP request's
/// body may be.
pub const MAX_COMMAND: usize = crate::engine::MAX_BODY;

/// The most arguments, and bytes of arguments, a command may have before its connection has
/// authenticated: Redis's bounds for such clients (10 arguments, 16 KiB), enough for `AUTH`
/// and `HELLO 3 AUTH user token SETNAME name` with any sensible token.
pub const UNAUTHENTICATED_ARGS: usize = 10;
/// See [`UNAUTHENTICATED_ARGS`].
pub const UNAUTHENTICATED_COMMAND: usize = 16 * 1024;

/// What one command may be: [`MAX_ARGS`] arguments of [`MAX_COMMAND`] bytes together, or
/// less before the connection has authenticated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    /// Arguments, the command's name included.
    pub args: usize,
    /// Bytes of arguments together.
    pub bytes: usize,
    /// Whether these are the bounds of a connection that has not authenticated (its errors
    /// say so, in Redis's words).
    pub unauthenticated: bool,
}

impl Bounds {
    /// A connection that has authenticated, or needs not.
    pub const AUTHENTICATED: Bounds =
        Bounds { args: MAX_ARGS, bytes: MAX_COMMAND, unauthenticated: false };
    /// A connection that must still authenticate.
    pub const UNAUTHENTICATED: Bounds = Bounds {
        args: UNAUTHENTICATED_ARGS,
        bytes: UNAUTHENTICATED_COMMAND,
        unauthenticated: true,
    };
}

/// A request the connection cannot go on from: answered `-ERR Protocol error: ...`, then
/// the connection is closed (as Redis does), since where the next command starts is unknown.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProtocolError(pub String);

impl ProtocolError {
    fn new(what: impl Into<String>) -> Self {
        ProtocolError(what.into())
    }
}

/// Reads the first command of `buf`: its arguments as ranges of `buf` in `args` (cleared
/// first) and how many bytes it took, or `None` while it is not all there. An empty command
/// (`*0`, `*-1`, a blank line) gives no arguments.
///
/// # Errors
///
/// The bytes are not a command, or break one of `bounds`: even incomplete, a command is
/// refused as soon as it says it will.
pub fn parse(
    buf: &[u8],
    args: &mut Vec<Range<usize>>,
    bounds: Bounds,
) -> Result<Option<usize>, ProtocolError> {
    args.clear();
    match buf.first() {
        None => Ok(None),
        Some(b'*') => multibulk(buf, args, bounds),
        Some(_) => inline(buf, args, bounds),
    }
}

/// The line that starts at `at`, without its `\r\n`, and where the next one starts; `None`
/// while incomplete. A line longer than `most` is an error.
fn line(
    buf: &[u8],
    at: usize,
    most: usize,
    what: &str,
) -> Result<Option<(Range<usize>, usize)>, ProtocolError> {
    let window = &buf[at..buf.len().min(at + most + 2)];
    match memchr::memchr(b'\r', window) {
        Some(i) if i + 1 < window.len() => {
            if window[i + 1] != b'\n' {
                return Err(ProtocolError::new(format!("expected \\r\\n after {what}")));
            }
            Ok(Some((at..at + i, at + i + 2)))
        }
        Some(_) => Ok(None),
        None if window.len() > most + 1 => Err(ProtocolError::new(format!("{what} is too long"))),
        None => Ok(None),
    }
}

/// A decimal integer, as RESP writes lengths.
fn integer(bytes: &[u8]) -> Option<i64> {
    let (negative, digits) = match bytes {
        [b'-', rest @ ..] => (true, rest),
        _ => (false, bytes),
    };
    if digits.is_empty() || digits.len() > 18 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n = digits.iter().fold(0i64, |n, d| n * 10 + i64::from(d - b'0'));
    Some(if negative { -n } else { n })
}

fn multibulk(
    buf: &[u8],
    args: &mut Vec<Range<usize>>,
    bounds: Bounds,
) -> Result<Option<usize>, ProtocolError> {
    let Some((count, mut at)) = line(buf, 1, 20, "the multibulk length")? else {
        return Ok(None);
    };
    let count = match integer(&buf[count]) {
        Some(n) if n <= 0 => return Ok(Some(at)),
        Some(n) if n as u64 <= bounds.args as u64 => n as usize,
        Some(_) if bounds.unauthenticated => {
            return Err(ProtocolError::new("unauthenticated multibulk length"));
        }
        Some(n) => {
            return Err(ProtocolError::new(format!(
                "invalid multibulk length {n}: a command has at most {MAX_ARGS} arguments here"
            )));
        }
        None => return Err(ProtocolError::new("invalid multibulk length")),
    };
    let mut total = 0usize;
    for _ in 0..count {
        let Some(&first) = buf.get(at) else { return Ok(None) };
        if first != b'$' {
            return Err(ProtocolError::new(format!(
                "expected '$', got '{}'",
                char::from(first).escape_default()
            )));
        }
        let Some((length, start)) = line(buf, at + 1, 20, "a bulk length")? else {
            return Ok(None);
        };
        let length = match integer(&buf[length]) {
            Some(n) if n >= 0 && total + n as usize <= bounds.bytes => n as usize,
            Some(n) if n >= 0 && bounds.unauthenticated => {
                return Err(ProtocolError::new("unauthenticated bulk length"));
            }
            Some(n) if n >= 0 => {
                return Err(ProtocolError::new(format!(
                    "invalid bulk length {n}: a command's arguments take at most {MAX_COMMAND} \
                     bytes here"
                )));
            }
            _ => return Err(ProtocolError::new("invalid bulk length")),
        };
        total += length;
        let end = start + length;
        if buf.len() < end + 2 {
            return Ok(None);
        }
        if &buf[end..end + 2] != b"\r\n" {
            return Err(ProtocolError::new("expected \\r\\n after a bulk string"));
        }
        args.push(start..end);
        at = end + 2;
    }
    Ok(Some(at))
}

/// A line of words, as `telnet` sends: split on spaces and tabs, `"..."` and `'...'` quote
/// (with `\"`, `\\`, `\n`, `\r`, `\t` and `\xHH` in double quotes left for later: the
/// quoted bytes are taken as they are).
fn inline(
    buf: &[u8],
    args: &mut Vec<Range<usize>>,
    bounds: Bounds,
) -> Result<Option<usize>, ProtocolError> {
    let Some(newline) = memchr::memchr(b'\n', &buf[..buf.len().min(bounds.bytes + 1)]) else {
        if buf.len() > bounds.bytes {
            return Err(ProtocolError::new("too big inline request"));
        }
        return Ok(None);
    };
    let end = if newline > 0 && buf[newline - 1] == b'\r' { newline - 1 } else { newline };
    let mut at = 0;
    while at < end {
        match buf[at] {
            b' ' | b'\t' => at += 1,
            quote @ (b'"' | b'\'') => {
                let close = buf[at + 1..end].iter().position(|&b| b == quote);
                let Some(close) = close else {
                    return Err(ProtocolError::new("unbalanced quotes in request"));
                };
                args.push(at + 1..at + 1 + close);
                at += close + 2;
            }
            _ => {
                let word = buf[at..end].iter().position(|&b| b == b' ' || b == b'\t');
                let stop = word.map_or(end, |w| at + w);
                args.push(at..stop);
                at = stop;
            }
        }
        if args.len() > bounds.args && bounds.unauthenticated {
            return Err(ProtocolError::new("unauthenticated multibulk length"));
        }
        if args.len() > bounds.args {
            return Err(ProtocolError::new(format!(
                "invalid multibulk length: a command has at most {MAX_ARGS} arguments here"
            )));
        }
    }
    Ok(Some(newline + 1))
}

/// The protocol a connection speaks: RESP2 until `HELLO 3`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// RESP2: maps are flat arrays, booleans integers, doubles bulk strings.
    Resp2,
    /// RESP3.
    Resp3,
}

/// Replies written one after another into one buffer, sent whole.
pub struct Out {
    /// The bytes to send.
    pub buf: Vec<u8>,
    /// How types RESP2 lacks are written.
    pub protocol: Protocol,
}

impl Out {
    /// An empty buffer for RESP2.
    pub fn new() -> Self {
        Out { buf: Vec::with_capacity(4096), protocol: Protocol::Resp2 }
    }

    fn line(&mut self, kind: u8, text: &[u8]) {
        self.buf.push(kind);
        self.buf.extend_from_slice(text);
        self.buf.extend_from_slice(b"\r\n");
    }

    fn number_line(&mut self, kind: u8, n: i64) {
        self.buf.push(kind);
        self.buf.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
        self.buf.extend_from_slice(b"\r\n");
    }

    /// `+text`.
    pub fn simple(&mut self, text: &str) {
        self.line(b'+', text.as_bytes());
    }

    /// `-ERR message`.
    pub fn error(&mut self, message: &str) {
        self.coded("ERR", message);
    }

    /// `-CODE message` (`NOAUTH`, `WRONGPASS`...). A line break in the message would end
    /// the reply early: it becomes a space.
    pub fn coded(&mut self, code: &str, message: &str) {
        self.buf.push(b'-');
        self.buf.extend_from_slice(code.as_bytes());
        self.buf.push(b' ');
        self.buf.extend(message.bytes().map(|b| if b == b'\r' || b == b'\n' { b' ' } else { b }));
        self.buf.extend_from_slice(b"\r\n");
    }

    /// `:n`.
    pub fn integer(&mut self, n: i64) {
        self.number_line(b':', n);
    }

    /// `$len` and the bytes.
    pub fn bulk(&mut self, bytes: &[u8]) {
        self.number_line(b'$', bytes.len() as i64);
        self.buf.extend_from_slice(bytes);
        self.buf.extend_from_slice(b"\r\n");
    }

    /// A bulk string in RESP2, a verbatim string (`=len`, `txt:`) in RESP3, as `INFO` answers.
    pub fn verbatim(&mut self, text: &str) {
        match self.protocol {
            Protocol::Resp2 => self.bulk(text.as_bytes()),
            Protocol::Resp3 => {
                self.number_line(b'=', text.len() as i64 + 4);
                self.buf.extend_from_slice(b"txt:");
                self.buf.extend_from_slice(text.as_bytes());
                self.buf.extend_from_slice(b"\r\n");
            }
        }
    }

    /// Nothing: `$-1` in RESP2, `_` in RESP3.
    pub fn null(&mut self) {
        match self.protocol {
            Protocol::Resp2 => self.buf.extend_from_slice(b"$-1\r\n"),
            Protocol::Resp3 => self.buf.extend_from_slice(b"_\r\n"),
        }
    }

    /// `*n`: `n` replies follow.
    pub fn array(&mut self, n: usize) {
        self.number_line(b'*', n as i64);
    }

    /// `%n` in RESP3; in RESP2 an array of `2n` (field, value, field, value...).
    pub fn map(&mut self, n: usize) {
        match self.protocol {
            Protocol::Resp2 => self.number_line(b'*', 2 * n as i64),
            Protocol::Resp3 => self.number_line(b'%', n as i64),
        }
    }

    /// `#t`/`#f` in RESP3, `:1`/`:0` in RESP2.
    pub fn boolean(&mut self, yes: bool) {
        match self.protocol {
            Protocol::Resp2 => self.integer(i64::from(yes)),
            Protocol::Resp3 => self.buf.extend_from_slice(if yes { b"#t\r\n" } else { b"#f\r\n" }),
        }
    }

    /// A number in its shortest form: an integer reply when it is whole, else a double
    /// (RESP3) or its text as a bulk string (RESP2, as Redis answers `INCRBYFLOAT`).
    pub fn number(&mut self, x: f64) {
        if x.fract() == 0.0 && x.abs() < 9_007_199_254_740_992.0 {
            return self.integer(x as i64);
        }
        let text = match serde_json::Number::from_f64(x) {
            Some(n) => n.to_string(),
            None if x.is_nan() => "nan".to_owned(),
            None if x > 0.0 => "inf".to_owned(),
            None => "-inf".to_owned(),
        };
        match self.protocol {
            Protocol::Resp2 => self.bulk(text.as_bytes()),
            Protocol::Resp3 => self.line(b',', text.as_bytes()),
        }
    }

    /// A JSON value: objects as maps, arrays as arrays, booleans, numbers ([`Out::number`]),
    /// strings as bulk strings, `null` as nothing.
    pub fn json(&mut self, value: &serde_json::Value) {
        use serde_json::Value;
        match value {
            Value::Null => self.null(),
            Value::Bool(yes) => self.boolean(*yes),
            Value::Number(n) => match n.as_i64() {
                Some(i) => self.integer(i),
                None => self.number(n.as_f64().unwrap_or(f64::NAN)),
            },
            Value::String(s) => self.bulk(s.as_bytes()),
            Value::Array(items) => {
                self.array(items.len());
                for item in items {
                    self.json(item);
                }
            }
            Value::Object(fields) => {
                self.map(fields.len());
                for (field, value) in fields {
                    self.bulk(field.as_bytes());
                    self.json(value);
                }
            }
        }
    }
}

impl Default for Out {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(buf: &[u8]) -> Result<Option<(Vec<String>, usize)>, ProtocolError> {
        words_within(buf, Bounds::AUTHENTICATED)
    }

    fn words_within(
        buf: &[u8],
        bounds: Bounds,
    ) -> Result<Option<(Vec<String>, usize)>, ProtocolError> {
        let mut args = Vec::new();
        Ok(parse(buf, &mut args, bounds)?.map(|used| {
            let words = args
                .iter()
                .map(|r| String::from_utf8_lossy(&buf[r.clone()]).into_owned())
                .collect();
            (words, used)
        }))
    }

    #[test]
    fn a_multibulk_command_is_read_whole_or_not_at_all() {
        let command = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$5\r\nhello\r\n*1\r\n";
        let (args, used) = words(command).unwrap().unwrap();
        assert_eq!(args, ["SET", "k", "hello"]);
        assert_eq!(used, command.len() - 4);
        // Every prefix of it is incomplete, not an error.
        for end in 0..used {
            assert_eq!(words(&command[..end]).unwrap(), None, "{end}");
        }
        assert_eq!(words(b"*0\r\n").unwrap(), Some((vec![], 4)));
        assert_eq!(words(b"*-1\r\n").unwrap(), Some((vec![], 5)));
        // Binary arguments, \r\n inside a bulk string.
        let (args, _) = words(b"*1\r\n$4\r\na\r\nb\r\n").unwrap().unwrap();
        assert_eq!(args, ["a\r\nb"]);
    }

    #[test]
    fn an_inline_command_is_split_into_words() {
        let (args, used) = words(b"PING\r\n").unwrap().unwrap();
        assert_eq!((args, used), (vec!["PING".to_owned()], 6));
        let (args, _) = words(b"  CL.THROTTLE\t 'a key' 15 \"30\" 60\n").unwrap().unwrap();
        assert_eq!(args, ["CL.THROTTLE", "a key", "15", "30", "60"]);
        assert_eq!(words(b"\r\n").unwrap(), Some((vec![], 2)));
        assert_eq!(words(b"PING").unwrap(), None);
        assert!(words(b"ECHO \"open\r\n").unwrap_err().0.contains("unbalanced quotes"));
    }

    #[test]
    fn bounds_are_errors_before_the_bytes_arrive() {
        let err = words(b"*5000\r\n").unwrap_err();
        assert!(err.0.starts_with("invalid multibulk length 5000"), "{err:?}");
        let err = words(b"*2\r\n$3\r\nGET\r\n$100000\r\n").unwrap_err();
        assert!(err.0.starts_with("invalid bulk length 100000"), "{err:?}");
        assert_eq!(words(b"*x\r\n").unwrap_err().0, "invalid multibulk length");
        assert_eq!(words(b"*1\r\n$-2\r\n").unwrap_err().0, "invalid bulk length");
        assert_eq!(words(b"*1\r\n+PING\r\n").unwrap_err().0, "expected '$', got '+'");
        assert!(words(b"*1\r\n$4\r\nPINGxx").is_err());
        // A length line that never ends.
        assert!(words(&[b'*'; 64]).is_err());
        let long = vec![b'a'; MAX_COMMAND + 2];
        assert_eq!(words(&long).unwrap_err().0, "too big inline request");
    }

    #[test]
    fn before_auth_the_bounds_are_redis_ones() {
        let before = Bounds::UNAUTHENTICATED;
        let err = words_within(b"*11\r\n", before).unwrap_err();
        assert_eq!(err.0, "unauthenticated multibulk length");
        let err = words_within(b"*2\r\n$4\r\nAUTH\r\n$16381\r\n", before).unwrap_err();
        assert_eq!(err.0, "unauthenticated bulk length");
        let ten = format!("AUTH{}\r\n", " x".repeat(9)).into_bytes();
        assert_eq!(words_within(&ten, before).unwrap().unwrap().0.len(), 10);
        let eleven = format!("AUTH{}\r\n", " x".repeat(10)).into_bytes();
        assert!(words_within(&eleven, before).is_err());
        let long = vec![b'a'; UNAUTHENTICATED_COMMAND + 2];
        assert_eq!(words_within(&long, before).unwrap_err().0, "too big inline request");
        // The same commands, once authenticated.
        assert_eq!(words(b"*11\r\n").unwrap(), None);
        assert!(words(&eleven).unwrap().is_some());
    }

    #[test]
    fn replies_in_each_protocol() {
        let mut out = Out::new();
        out.map(1);
        out.bulk(b"ok");
        out.boolean(true);
        out.number(2.5);
        out.number(3.0);
        out.null();
        out.error("Rate limit x not defined.\nDefine it");
        out.coded("NOAUTH", "Authentication required.");
        assert_eq!(
            String::from_utf8(out.buf).unwrap(),
            "*2\r\n$2\r\nok\r\n:1\r\n$3\r\n2.5\r\n:3\r\n$-1\r\n\
             -ERR Rate limit x not defined. Define it\r\n-NOAUTH Authentication required.\r\n"
        );
        let mut out = Out { buf: Vec::new(), protocol: Protocol::Resp3 };
        out.json(&serde_json::json!({ "ok": false, "retryAfter": 0.5, "results": [null] }));
        assert_eq!(
            String::from_utf8(out.buf).unwrap(),
            "%3\r\n$2\r\nok\r\n#f\r\n$7\r\nresults\r\n*1\r\n_\r\n$10\r\nretryAfter\r\n,0.5\r\n"
        );
    }
}
