//! The latency algorithms and the chains: recursive doubling (small all-reduces), binomial
//! trees (small broadcasts and reduces), pipelined chains (large broadcasts and reduces) and the
//! dissemination barrier.

use super::{Buf, Builder, Op, Region, Request, slices, split};

/// Recursive doubling over the largest power of two `p ≤ n`; ranks `p..n` first hand their
/// input to rank `r - p` and get the result back at the end. Each round receives into
/// scratch and reduces after its own send is done, so any message size is deadlock-free;
/// out of place, a first round that sends the input receives straight into the output,
/// reduced with the input (the send only reads the input, so nothing waits on it).
pub(super) fn recursive_doubling(
    b: &mut Builder,
    n: usize,
    r: usize,
    count: usize,
    in_place: bool,
) {
    let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let all = |buf| Region::new(buf, 0, count);
    if r >= p {
        let sent = b.send(r - p, 0, all(Buf::Input), &[]);
        b.recv(r - p, 0, all(Buf::Output), None, &[Some(sent)]);
        return;
    }
    // Where the running result is, and the step that made it.
    let (mut acc, mut last) = if r + p < n {
        let got = b.recv(r + p, 0, all(Buf::Output), Some(all(Buf::Input)), &[]);
        (Buf::Output, Some(got))
    } else if in_place {
        (
            Buf::Output,
            Some(b.copy(all(Buf::Input), all(Buf::Output), &[])),
        )
    } else {
        (Buf::Input, None)
    };
    let mut mask = 1;
    while mask < p {
        let partner = r ^ mask;
        let send = b.send(partner, 0, all(acc), &[last]);
        if acc == Buf::Input {
            last = Some(b.recv(partner, 0, all(Buf::Output), Some(all(Buf::Input)), &[]));
        } else {
            b.scratch = count;
            let recv = b.recv(partner, 0, all(Buf::Scratch), None, &[last]);
            last = Some(b.push(
                Op::Reduce {
                    dst: all(Buf::Output),
                    a: all(Buf::Output),
                    b: all(Buf::Scratch),
                },
                [Some(send), Some(recv)],
            ));
        }
        acc = Buf::Output;
        mask <<= 1;
    }
    if r + p < n {
        b.send(r + p, 0, all(Buf::Output), &[last]);
    }
}

/// Binomial tree on ranks relative to the root: `v`'s parent is `v` without its highest bit;
/// its children are `v + 2^j` for every `2^j` above that bit.
fn tree_children(n: usize, v: usize) -> Vec<usize> {
    let top = if v == 0 {
        0
    } else {
        usize::BITS - v.leading_zeros()
    };
    (top..usize::BITS)
        .map(|j| 1usize << j)
        .take_while(|&m| v + m < n && m > v)
        .map(|m| v + m)
        .collect()
}

fn tree_parent(v: usize) -> usize {
    v & !(1usize << (usize::BITS - 1 - v.leading_zeros()))
}

pub(super) fn tree_broadcast(b: &mut Builder, n: usize, r: usize, count: usize, root: usize) {
    let v = (r + n - root) % n;
    let out = Region::new(Buf::Output, 0, count);
    let (src, got) = if v == 0 {
        (Region::new(Buf::Input, 0, count), None)
    } else {
        let parent = (tree_parent(v) + root) % n;
        (out, Some(b.recv(parent, 0, out, None, &[])))
    };
    // Largest subtree first.
    for c in tree_children(n, v).into_iter().rev() {
        b.send((c + root) % n, 0, src, &[got]);
    }
}

pub(super) fn tree_reduce(b: &mut Builder, n: usize, r: usize, count: usize, root: usize) {
    let v = (r + n - root) % n;
    let acc = if v == 0 {
        Region::new(Buf::Output, 0, count)
    } else {
        b.scratch = count;
        Region::new(Buf::Scratch, 0, count)
    };
    let mut cur = Region::new(Buf::Input, 0, count);
    let mut last = None;
    for c in tree_children(n, v) {
        last = Some(b.recv((c + root) % n, 0, acc, Some(cur), &[last]));
        cur = acc;
    }
    if v == 0 {
        if last.is_none() {
            b.copy(cur, acc, &[]);
        }
    } else {
        b.send((tree_parent(v) + root) % n, 0, cur, &[last]);
    }
}

pub(super) fn chain_broadcast(b: &mut Builder, req: &Request, count: usize, root: usize) {
    let (n, r) = (req.world, req.rank);
    if n == 1 {
        return;
    }
    let v = (r + n - root) % n;
    let next = (r + 1) % n;
    let prev = (r + n - 1) % n;
    let k = slices(count, req.chunk);
    for s in 0..k {
        let (o, l) = split(count, k, s);
        let out = Region::new(Buf::Output, o, l);
        if v == 0 {
            b.send(next, 0, Region::new(Buf::Input, o, l), &[]);
        } else {
            let got = b.recv(prev, 0, out, None, &[]);
            if v + 1 < n {
                b.send(next, 0, out, &[Some(got)]);
            }
        }
    }
}

/// The chain runs from relative rank `n-1` down to the root: each rank adds its input to what
/// arrives from `v+1` and passes it to `v-1`.
pub(super) fn chain_reduce(b: &mut Builder, req: &Request, count: usize, root: usize) {
    let (n, r) = (req.world, req.rank);
    let v = (r + n - root) % n;
    let up = (r + 1) % n; // relative v+1
    let down = (r + n - 1) % n; // relative v-1
    let acc_buf = if v == 0 { Buf::Output } else { Buf::Scratch };
    if v != 0 && v + 1 < n {
        b.scratch = count;
    }
    let k = slices(count, req.chunk);
    for s in 0..k {
        let (o, l) = split(count, k, s);
        let input = Region::new(Buf::Input, o, l);
        if v + 1 == n {
            b.send(down, 0, input, &[]);
        } else {
            let acc = Region::new(acc_buf, o, l);
            let got = b.recv(up, 0, acc, Some(input), &[]);
            if v != 0 {
                b.send(down, 0, acc, &[Some(got)]);
            }
        }
    }
}

pub(super) fn dissemination(b: &mut Builder, n: usize, r: usize) {
    let mut last = None;
    let mut d = 1;
    while d < n {
        let empty = Region::new(Buf::Input, 0, 0);
        b.send((r + d) % n, 0, empty, &[last]);
        last = Some(b.recv(
            (r + n - d) % n,
            0,
            Region::new(Buf::Output, 0, 0),
            None,
            &[last],
        ));
        d <<= 1;
    }
}
