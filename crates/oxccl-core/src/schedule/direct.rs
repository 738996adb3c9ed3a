//! Direct exchanges, every pair of ranks talking to each other: the one-round all-reduce of
//! small messages, all-to-all(v), gather, scatter and point to point; and the direct phases
//! (reduce-scatter, all-gather, all-reduce into blocks) that the proportional and two-tier
//! schedules are made of.

use super::{Buf, Builder, Done, Op, Region, slices, split};

/// Every rank sends its whole input to every other rank and reduces all of them itself, in
/// rank order (so every rank computes bit-identical results): one round of messages, for small
/// messages between ranks of one host. In place, the input first moves to scratch, since the
/// output is written before every send is done.
pub(super) fn direct_all_reduce(b: &mut Builder, n: usize, r: usize, count: usize, in_place: bool) {
    b.scratch = n * count;
    let slot = |j: usize| Region::new(Buf::Scratch, j * count, count);
    let (own, saved) = if in_place {
        let c = b.copy(Region::new(Buf::Input, 0, count), slot(r), &[]);
        (slot(r), Some(c))
    } else {
        (Region::new(Buf::Input, 0, count), None)
    };
    let mut sends = Vec::new();
    for i in 1..n {
        sends.push(Some(b.send((r + i) % n, 0, own, &[saved])));
    }
    let mut got = vec![None; n];
    for i in 1..n {
        let p = (r + n - i) % n;
        got[p] = Some(b.recv(p, 0, slot(p), None, &[]));
    }
    let src = |j: usize| if j == r { own } else { slot(j) };
    let out = Region::new(Buf::Output, 0, count);
    // The output may be the input: write it only after every send has read the input. The
    // sum runs in rank order, so every rank computes the same bits; its first term is
    // reduced with the second straight into the output (no copy first).
    let mut first = sends.clone();
    first.extend([got[0], got[1], saved]);
    let mut last = b.push(
        Op::Reduce {
            dst: out,
            a: src(0),
            b: src(1),
        },
        first,
    );
    for (j, &arrived) in got.iter().enumerate().skip(2) {
        last = b.push(
            Op::Reduce {
                dst: out,
                a: out,
                b: src(j),
            },
            [Some(last), arrived],
        );
    }
}

/// The fewest slices `Algorithm::Proportional` cuts a block into.
const PROPORTIONAL_SLICES: usize = 16;

/// Slices per block of a direct phase: at least [`PROPORTIONAL_SLICES`], so that a block's
/// gather overlaps its reduction.
pub(super) fn phase_slices(blocks: &[(usize, usize)], chunk: usize) -> usize {
    let largest = blocks.iter().map(|b| b.1).max().unwrap_or(0);
    slices(largest, chunk).max(PROPORTIONAL_SLICES.min(largest.max(1)))
}

/// How many slices a direct all-reduce's reduce-scatter runs ahead of its all-gather in a
/// peer's queue (see [`direct_all_reduce_part`]).
const DIRECT_LEAD: usize = 4;

/// Direct all-reduce among `members` (a reduce-scatter into `blocks` of `src`, this rank's
/// block folded into `own`, then an all-gather into the output), emitted slice by slice,
/// the reduce-scatter [`DIRECT_LEAD`] slices ahead: slice `s`'s gather follows the
/// reduce-scatter of slice `s + DIRECT_LEAD` in every (peer, channel) queue. No gathered
/// slice waits behind the reduce-scatter of all later slices (which, with one slow
/// contributor, held every gather until its last byte), and no reduce-scatter slice waits
/// for a gather a whole round trip away (which, over long links, cost a round trip per
/// slice). Returns where the output became final.
#[allow(clippy::too_many_arguments)]
pub(super) fn direct_all_reduce_part(
    b: &mut Builder,
    members: &[usize],
    me: usize,
    blocks: &[(usize, usize)],
    k: usize,
    src: Buf,
    own: (Buf, usize),
    after: &dyn Fn(usize, usize) -> Vec<Option<u32>>,
) -> Done {
    let m = members.len();
    let i = members.iter().position(|&x| x == me).expect("a member");
    let slice = |blk: usize, s: usize| {
        let (o, l) = blocks[blk];
        let (so, sl) = split(l, k, s);
        (o + so, sl)
    };
    let peers: Vec<usize> = (1..m).map(|d| (i + d) % m).collect();
    let mut done = Done::default();
    // Per slice: this rank's sends of its contributions, and the step after which its own
    // block's slice is reduced.
    let mut sent: Vec<Vec<Option<u32>>> = Vec::with_capacity(k);
    let mut reduced: Vec<Option<u32>> = Vec::with_capacity(k);
    let reduce_scatter = |b: &mut Builder, done: &mut Done, s: usize| {
        let mut out = vec![None; m];
        for &j in &peers {
            let (o, l) = slice(j, s);
            if l > 0 {
                out[j] = Some(b.send(members[j], 0, Region::new(src, o, l), &after(o, l)));
            }
        }
        let (mo, ml) = slice(i, s);
        let mut last = None;
        if ml > 0 {
            let dst = Region::new(own.0, own.1 + mo - blocks[i].0, ml);
            for (n, &j) in peers.iter().rev().enumerate() {
                let (with, mut deps) = if n == 0 {
                    (Region::new(src, mo, ml), after(mo, ml))
                } else {
                    (dst, Vec::new())
                };
                deps.push(last);
                last = Some(b.recv(members[j], 0, dst, Some(with), &deps));
            }
            done.add(dst.offset, ml, last);
        }
        (out, last)
    };
    for s in 0..k.min(DIRECT_LEAD) {
        let (o, r) = reduce_scatter(b, &mut done, s);
        sent.push(o);
        reduced.push(r);
    }
    for s in 0..k {
        // All-gather of slice s: this rank's reduced slice to every other member.
        let (mo, ml) = slice(i, s);
        if ml > 0 {
            let out = Region::new(Buf::Output, mo, ml);
            for &j in &peers {
                b.send(members[j], 0, out, &[reduced[s]]);
            }
        }
        for &j in &peers {
            let (o, l) = slice(j, s);
            if l > 0 {
                let part = Region::new(Buf::Output, o, l);
                let id = b.recv(members[j], 0, part, None, &[sent[s][j]]);
                done.add(o, l, Some(id));
            }
        }
        if s + DIRECT_LEAD < k {
            let (o, r) = reduce_scatter(b, &mut done, s + DIRECT_LEAD);
            sent.push(o);
            reduced.push(r);
        }
    }
    done
}

/// How a direct phase cuts its blocks: slice `s` of block `j` as (offset, len).
pub(super) type Cut<'a> = &'a dyn Fn(usize, usize) -> (usize, usize);

/// Each block cut into `k` nearly equal slices.
pub(super) fn even_cut(
    blocks: &[(usize, usize)],
    k: usize,
) -> impl Fn(usize, usize) -> (usize, usize) + '_ {
    move |j, s| {
        let (o, l) = blocks[j];
        let (so, sl) = split(l, k, s);
        (o + so, sl)
    }
}

/// What a direct reduce-scatter left: per member and slice, the send of this rank's
/// contribution; where this rank's reduced slices are, and after which steps.
pub(super) struct ReduceScatter {
    pub(super) sent: Vec<Vec<Option<u32>>>,
    pub(super) done: Done,
}

/// Direct reduce-scatter among `members` (this rank is `me`, one of them; member `j` owns
/// `blocks[j]` of `src`, cut into `k` slices): every contribution is sent from `src` (the
/// input, or a buffer holding a partial result) once `after` (given the part read) is done;
/// the owner folds them into its block's destination `own` (a buffer and where the block
/// starts in it) in one chain per slice.
#[allow(clippy::too_many_arguments)]
pub(super) fn direct_reduce_scatter(
    b: &mut Builder,
    members: &[usize],
    me: usize,
    blocks: &[(usize, usize)],
    (k, slice): (usize, Cut<'_>),
    src: Buf,
    own: (Buf, usize),
    after: &dyn Fn(usize, usize) -> Vec<Option<u32>>,
) -> ReduceScatter {
    let m = members.len();
    let i = members.iter().position(|&x| x == me).expect("a member");
    // Everyone starts with a different peer, so that no owner gets everything at once.
    let peers: Vec<usize> = (1..m).map(|d| (i + d) % m).collect();
    let mut out = ReduceScatter {
        sent: vec![vec![None; k]; m],
        done: Done::default(),
    };
    for s in 0..k {
        for &j in &peers {
            let (o, l) = slice(j, s);
            if l > 0 {
                let id = b.send(members[j], 0, Region::new(src, o, l), &after(o, l));
                out.sent[j][s] = Some(id);
            }
        }
        let (mo, ml) = slice(i, s);
        if ml > 0 {
            let dst = Region::new(own.0, own.1 + mo - blocks[i].0, ml);
            let mut last = None;
            for (n, &j) in peers.iter().rev().enumerate() {
                let (with, mut deps) = if n == 0 {
                    (Region::new(src, mo, ml), after(mo, ml))
                } else {
                    (dst, Vec::new())
                };
                deps.push(last);
                last = Some(b.recv(members[j], 0, dst, Some(with), &deps));
            }
            out.done.add(dst.offset, ml, last);
        }
    }
    out
}

/// Direct all-gather among `members`: this rank's block, slice `s` once `ready[s]` is done,
/// to every other member; every other member's block into the output, slice `s` of member
/// `j`'s once `war[j][s]` (the last read of that memory) is done. Returns the receives.
pub(super) fn direct_all_gather(
    b: &mut Builder,
    members: &[usize],
    me: usize,
    (k, cut): (usize, Cut<'_>),
    ready: &[Vec<Option<u32>>],
    war: &[Vec<Option<u32>>],
) -> Done {
    let m = members.len();
    let i = members.iter().position(|&x| x == me).expect("a member");
    let slice = |blk: usize, s: usize| {
        let (o, l) = cut(blk, s);
        Region::new(Buf::Output, o, l)
    };
    let peers: Vec<usize> = (1..m).map(|d| (i + d) % m).collect();
    let mut got = Done::default();
    for s in 0..k {
        if slice(i, s).len > 0 {
            for &j in &peers {
                b.send(members[j], 0, slice(i, s), &ready[s]);
            }
        }
        for &j in &peers {
            let part = slice(j, s);
            if part.len > 0 {
                let id = b.recv(members[j], 0, part, None, &[war[j][s]]);
                got.add(part.offset, part.len, Some(id));
            }
        }
    }
    got
}

/// At step `i`, rank `r` exchanges with `(i - r) mod n`: a perfect matching per step (its own
/// block when the partner is itself), so every pair of ranks talks at the same step. In place,
/// blocks arrive in scratch and move to the buffer once the same block has been sent (waiting
/// in the receive itself could deadlock when a block spans more fragments than slots).
pub(super) fn pairwise(
    b: &mut Builder,
    n: usize,
    r: usize,
    send_counts: &[usize],
    recv_counts: &[usize],
    in_place: bool,
) {
    let offsets = |counts: &[usize]| {
        let mut acc = 0;
        counts
            .iter()
            .map(|&c| {
                let o = acc;
                acc += c;
                o
            })
            .collect::<Vec<_>>()
    };
    let so = offsets(send_counts);
    let ro = offsets(recv_counts);
    if in_place {
        b.scratch = recv_counts.iter().sum();
    }
    for i in 0..n {
        let p = (i + n - r % n) % n;
        if p == r {
            b.copy(
                Region::new(Buf::Input, so[r], send_counts[r]),
                Region::new(Buf::Output, ro[r], recv_counts[r]),
                &[],
            );
            continue;
        }
        let sent = b.send(p, 0, Region::new(Buf::Input, so[p], send_counts[p]), &[]);
        let out = Region::new(Buf::Output, ro[p], recv_counts[p]);
        if in_place {
            // Block p of the buffer is still being sent: receive beside it, move it after.
            let tmp = Region::new(Buf::Scratch, ro[p], recv_counts[p]);
            let got = b.recv(p, 0, tmp, None, &[]);
            b.copy(tmp, out, &[Some(sent), Some(got)]);
        } else {
            b.recv(p, 0, out, None, &[]);
        }
    }
}

/// Every rank sends its input straight to the root, which copies its own into place.
pub(super) fn gather(b: &mut Builder, n: usize, r: usize, count: usize, root: usize) {
    let (input, output) = (Region::new(Buf::Input, 0, count), Buf::Output);
    if r == root {
        b.copy(input, Region::new(output, r * count, count), &[]);
        for p in (0..n).filter(|&p| p != r) {
            b.recv(p, 0, Region::new(output, p * count, count), None, &[]);
        }
    } else {
        b.send(root, 0, input, &[]);
    }
}

/// The root sends every rank its block straight, starting with the next rank, and copies its
/// own.
pub(super) fn scatter(b: &mut Builder, n: usize, r: usize, count: usize, root: usize) {
    let output = Region::new(Buf::Output, 0, count);
    if r == root {
        for i in 1..n {
            let p = (r + i) % n;
            b.send(p, 0, Region::new(Buf::Input, p * count, count), &[]);
        }
        b.copy(Region::new(Buf::Input, r * count, count), output, &[]);
    } else {
        b.recv(root, 0, output, None, &[]);
    }
}
