//! A plain loop of one operation, for profilers (`valgrind --tool=callgrind`).
use tollgate_bench::{tollgate, Limit};
fn main() {
    let t = tollgate();
    let mut ok = 0;
    for _ in 0..200_000 {
        ok += usize::from(t.limit(Limit::PerUser, std::hint::black_box("user-00000001")).unwrap().ok);
    }
    println!("{ok}");
}
