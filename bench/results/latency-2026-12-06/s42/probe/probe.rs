//! TEMPORARY: TSC marks along the receive-to-send window.
#![allow(missing_docs, unsafe_code)]
use std::cell::RefCell;
thread_local! {
    static M: RefCell<([u64; 24], Vec<[u64; 24]>)> = RefCell::new(([0; 24], Vec::new()));
}
#[inline(always)]
fn tsc() -> u64 {
    // SAFETY: rdtsc has no memory effects.
    unsafe { core::arch::x86_64::_rdtsc() }
}
/// Mark point `i`; 0 opens a window (clears later marks).
#[inline(always)]
pub fn mark(i: usize) {
    let t = tsc();
    M.with(|m| {
        let mut m = m.borrow_mut();
        if i == 0 {
            m.0 = [0; 24];
        }
        if i == 0 || m.0[0] != 0 {
            if m.0[i] == 0 { m.0[i] = t; }
        }
    });
}
/// Closes the window (at the sendmsg).
pub fn close() {
    let t = tsc();
    M.with(|m| {
        let mut m = m.borrow_mut();
        if m.0[0] == 0 { return; }
        m.0[23] = t;
        let w = m.0;
        m.1.push(w);
        m.0 = [0; 24];
        if m.1.len() == 60000 {
            report(&m.1);
        }
    });
}
fn report(v: &[[u64; 24]]) {
    let mut s = String::new();
    let mut prev_med = 0u64;
    for i in 1..24 {
        let mut d: Vec<u64> = v.iter().filter(|w| w[i] != 0).map(|w| w[i] - w[0]).collect();
        if d.is_empty() { continue; }
        d.sort_unstable();
        let med = d[d.len() / 2];
        s += &format!("  mark {i:2}: n {:6} median {:6} cyc from open (+{:5}), p10 {:6}\n", d.len(), med, med as i64 - prev_med as i64, d[d.len()/10]);
        prev_med = med;
    }
    eprintln!("probe {:?}:\n{s}", std::thread::current().id());
}
thread_local! {
    static G: RefCell<(u64, Vec<u64>)> = RefCell::new((0, Vec::new()));
}
/// Before a recv: closes the gap since the last empty recv.
pub fn gap_end() {
    let t = tsc();
    G.with(|g| {
        let mut g = g.borrow_mut();
        if g.0 != 0 {
            let d = t - g.0;
            g.1.push(d);
            g.0 = 0;
            if g.1.len() == 200000 {
                let mut v = g.1.clone();
                v.sort_unstable();
                eprintln!("gap {:?}: p10 {} p50 {} p90 {}", std::thread::current().id(), v[v.len()/10], v[v.len()/2], v[9*v.len()/10]);
            }
        }
    });
}
/// After a recv that found nothing.
pub fn gap_start() {
    let t = tsc();
    G.with(|g| g.borrow_mut().0 = t);
}
