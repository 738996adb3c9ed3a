//! Pipelined rings: all-reduce (a reduce-scatter then an all-gather around the ring, per
//! channel), reduce-scatter and all-gather; rings ordered host by host when the ranks of a host
//! are not consecutive. The parts of a ring the two-tier schedules reuse are here too.

use super::{Buf, Builder, Done, NOTHING, Region, Request, slices, split};

/// The ring over channel `ch`'s part of `count` elements: `(part offset, part len)`.
fn channel_part(count: usize, channels: usize, ch: usize) -> (usize, usize) {
    split(count, channels, ch)
}

/// The ring's order: ranks in order, or with [`Request::hosts`] host by host (hosts in order
/// of their lowest rank), so that the ring crosses each host's link once each way; and this
/// rank's place in it.
pub(super) fn ring_order(req: &Request) -> (Vec<usize>, usize) {
    let mut members: Vec<usize> = (0..req.world).collect();
    if !req.hosts.is_empty() {
        let first = |h: u32| req.hosts.iter().position(|&x| x == h).unwrap_or(0);
        members.sort_by_key(|&x| (first(req.hosts[x]), x));
    }
    let i = members
        .iter()
        .position(|&x| x == req.rank)
        .expect("a member");
    (members, i)
}

pub(super) fn ring_all_reduce(b: &mut Builder, req: &Request, count: usize) {
    let (members, i) = ring_order(req);
    let channels = req.channels.min(count).max(1);
    for ch in 0..channels {
        let part = channel_part(count, channels, ch);
        let c = ch as u8;
        ring_all_reduce_part(b, &members, i, part, req.chunk, c, Buf::Input, &NOTHING);
    }
}

/// Ring all-reduce of the output's elements `part` (offset, len) among `members` (this rank
/// is member `i`) on channel `c`, pipelined in slices of at most `chunk`: this rank's
/// contribution is in `src` (the input, or the output holding a partial result), read once
/// `after` (given the part read) is done. Returns when each part of the result became final.
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
pub(super) fn ring_all_reduce_part(
    b: &mut Builder,
    members: &[usize],
    i: usize,
    (poff, plen): (usize, usize),
    chunk: usize,
    c: u8,
    src: Buf,
    after: &dyn Fn(usize, usize) -> Vec<Option<u32>>,
) -> Done {
    let n = members.len();
    let r = i;
    let next = members[(r + 1) % n];
    let prev = members[(r + n - 1) % n];
    let block = |i: usize| {
        let (o, l) = split(plen, n, i % n);
        (poff + o, l)
    };
    let k = slices(plen.div_ceil(n), chunk);
    let slice = |blk: usize, s: usize| {
        let (o, l) = block(blk);
        let (so, sl) = split(l, k, s);
        (o + so, sl)
    };
    let mut done = Done::default();
    // Reduce-scatter: at step t send block r-t, receive block r-t-1 and reduce it.
    let mut rs_recv: Vec<Vec<u32>> = Vec::new();
    let mut rs_send: Vec<Vec<u32>> = Vec::new();
    for t in 0..n - 1 {
        let sb = (r + n - t) % n;
        let rb = (r + 2 * n - t - 1) % n;
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        for s in 0..k {
            let (so, sl) = slice(sb, s);
            let sent = if t == 0 {
                b.send(next, c, Region::new(src, so, sl), &after(so, sl))
            } else {
                let dep = Some(rs_recv[t - 1][s]);
                b.send(next, c, Region::new(Buf::Output, so, sl), &[dep])
            };
            sends.push(sent);
            let (ro, rl) = slice(rb, s);
            let (dst, with) = (Region::new(Buf::Output, ro, rl), Region::new(src, ro, rl));
            recvs.push(b.recv(prev, c, dst, Some(with), &after(ro, rl)));
        }
        rs_send.push(sends);
        rs_recv.push(recvs);
    }
    if n > 1 {
        for s in 0..k {
            let (o, l) = slice((r + 1) % n, s);
            done.add(o, l, Some(rs_recv[n - 2][s]));
        }
    }
    // All-gather: at step t send block r+1-t (reduced), receive block r-t.
    let mut ag_recv: Vec<u32> = Vec::new();
    for t in 0..n - 1 {
        let sb = (r + 1 + n - t) % n;
        let rb = (r + n - t) % n;
        let mut recvs = Vec::new();
        for s in 0..k {
            let (so, sl) = slice(sb, s);
            let dep = if t == 0 {
                rs_recv[n - 2][s]
            } else {
                ag_recv[s]
            };
            b.send(next, c, Region::new(Buf::Output, so, sl), &[Some(dep)]);
            let (ro, rl) = slice(rb, s);
            // Block r-t was sent at reduce-scatter step t: that send must be done. (Out of
            // place at t = 0 it read the input, but dropping this dependency measured
            // slower at 1 MiB on shm: the receive then competes with the send for the core.)
            let war = Some(rs_send[t][s]);
            let id = b.recv(prev, c, Region::new(Buf::Output, ro, rl), None, &[war]);
            done.add(ro, rl, Some(id));
            recvs.push(id);
        }
        ag_recv = recvs;
    }
    done
}

pub(super) fn ring_reduce_scatter(b: &mut Builder, req: &Request, count: usize) {
    let n = req.world;
    // Positions on the ring; position p's block is that of rank members[p].
    let (members, r) = ring_order(req);
    if n == 1 {
        b.copy(
            Region::new(Buf::Input, 0, count),
            Region::new(Buf::Output, 0, count),
            &[],
        );
        return;
    }
    let next = members[(r + 1) % n];
    let prev = members[(r + n - 1) % n];
    let channels = req.channels.min(count).max(1);
    // Partials travel through two scratch blocks, used alternately.
    b.scratch = 2 * count;
    for ch in 0..channels {
        let (poff, plen) = channel_part(count, channels, ch);
        let k = slices(plen, req.chunk);
        // Slice s of channel ch inside a block of `count` elements.
        let slice = |s: usize| {
            let (so, sl) = split(plen, k, s);
            (poff + so, sl)
        };
        let c = ch as u8;
        let mut prev_recv: Vec<u32> = Vec::new();
        let mut sends: Vec<Vec<u32>> = Vec::new();
        for t in 0..n - 1 {
            // Send block r-t-1, receive block r-t-2; the last receive is block r.
            let sb = members[(r + 2 * n - t - 1) % n];
            let rb = members[(r + 2 * n - t - 2) % n];
            let mut step_sends = Vec::new();
            let mut recvs = Vec::new();
            for s in 0..k {
                let (so, sl) = slice(s);
                let (src, dep) = if t == 0 {
                    (Region::new(Buf::Input, sb * count + so, sl), None)
                } else {
                    let sc = ((t - 1) % 2) * count;
                    (Region::new(Buf::Scratch, sc + so, sl), Some(prev_recv[s]))
                };
                step_sends.push(b.send(next, c, src, &[dep]));
                let with = Region::new(Buf::Input, rb * count + so, sl);
                let (dst, war) = if t == n - 2 {
                    (Region::new(Buf::Output, so, sl), None)
                } else {
                    // Scratch half t%2 was last sent at step t-1.
                    let war = if t >= 2 { Some(sends[t - 1][s]) } else { None };
                    (Region::new(Buf::Scratch, (t % 2) * count + so, sl), war)
                };
                recvs.push(b.recv(prev, c, dst, Some(with), &[war]));
            }
            sends.push(step_sends);
            prev_recv = recvs;
        }
    }
}

#[allow(clippy::needless_range_loop)] // slices index parallel per-step vectors
pub(super) fn ring_all_gather(b: &mut Builder, req: &Request, count: usize) {
    let n = req.world;
    b.copy(
        Region::new(Buf::Input, 0, count),
        Region::new(Buf::Output, req.rank * count, count),
        &[],
    );
    if n == 1 {
        return;
    }
    // Positions on the ring; position p's block is that of rank members[p].
    let (members, r) = ring_order(req);
    let next = members[(r + 1) % n];
    let prev = members[(r + n - 1) % n];
    let channels = req.channels.min(count).max(1);
    for ch in 0..channels {
        let (poff, plen) = channel_part(count, channels, ch);
        let k = slices(plen, req.chunk);
        let slice = |s: usize| {
            let (so, sl) = split(plen, k, s);
            (poff + so, sl)
        };
        let c = ch as u8;
        let mut prev_recv: Vec<u32> = Vec::new();
        for t in 0..n - 1 {
            let sb = members[(r + n - t) % n];
            let rb = members[(r + 2 * n - t - 1) % n];
            let mut recvs = Vec::new();
            for s in 0..k {
                let (so, sl) = slice(s);
                let (src, dep) = if t == 0 {
                    (Region::new(Buf::Input, so, sl), None)
                } else {
                    (
                        Region::new(Buf::Output, sb * count + so, sl),
                        Some(prev_recv[s]),
                    )
                };
                b.send(next, c, src, &[dep]);
                recvs.push(b.recv(
                    prev,
                    c,
                    Region::new(Buf::Output, rb * count + so, sl),
                    None,
                    &[],
                ));
            }
            prev_recv = recvs;
        }
    }
}

/// Ring all-gather among `members` (this rank is member `i`) of their blocks of the output,
/// on channel 0, pipelined in slices of at most `chunk`; this rank's own block is sent once
/// `own` is done. Returns the receives.
#[allow(clippy::needless_range_loop)] // slices index parallel per-step vectors
pub(super) fn ring_all_gather_part(
    b: &mut Builder,
    members: &[usize],
    i: usize,
    blocks: &[(usize, usize)],
    chunk: usize,
    own: Option<u32>,
) -> Done {
    let m = members.len();
    let (next, prev) = (members[(i + 1) % m], members[(i + m - 1) % m]);
    let k = slices(blocks.iter().map(|x| x.1).max().unwrap_or(0), chunk);
    let slice = |j: usize, s: usize| {
        let (o, l) = split(blocks[j].1, k, s);
        Region::new(Buf::Output, blocks[j].0 + o, l)
    };
    let mut got = Done::default();
    let mut prev_recv: Vec<Option<u32>> = vec![own; k];
    for t in 0..m - 1 {
        let sb = (i + m - t) % m;
        let rb = (i + 2 * m - t - 1) % m;
        for s in 0..k {
            b.send(next, 0, slice(sb, s), &[prev_recv[s]]);
            let id = b.recv(prev, 0, slice(rb, s), None, &[]);
            got.add(slice(rb, s).offset, slice(rb, s).len, Some(id));
            prev_recv[s] = Some(id);
        }
    }
    got
}
