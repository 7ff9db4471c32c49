//! Credit arithmetic: what a stream has free, how it is split between the brokers
//! that lead partitions, and when a change is worth a report. Pure functions.

use super::*;

/// The free credit of stream `s`: its clients' and its spare room's.
pub(super) fn free_of(s: &Aggregated) -> u64 {
    s.free + spare_offered(s)
}

/// The spare room a stream offers as credit.
pub(super) fn spare_offered(s: &Aggregated) -> u64 {
    if s.spare_paused {
        0
    } else {
        u64::from(s.spare_room.saturating_sub(s.spared))
    }
}

/// Whether a link should be told the stream's credit now: `credit` is its share of
/// the free credit plus the pushes received from it, the only sum the broker's view
/// depends on (it may push `share + received - sent` more; see the module doc), so
/// pushes alone change nothing. A view that shrank is corrected at once: the broker
/// must not push on credit that is gone. One that grew is corrected, as HTTP/2 sends
/// window updates, once the broker's view has fallen to half of its share or below (or
/// at once when the broker has jobs waiting for credit: `wanted`); until then it has
/// credit enough to push on, and a report per finished job would double the
/// messages of a pushed job on the link.
pub(super) fn worth_reporting(seen: &LinkStream, credit: u64, wanted: bool) -> bool {
    let Some((old_share, old_received)) = seen.reported else {
        return true;
    };
    let told = u64::from(old_share) + old_received;
    if credit == told {
        return false;
    }
    if credit < told || wanted {
        return true;
    }
    // What it may push, against what the broker believes.
    let share = credit.saturating_sub(seen.received);
    believed(seen).saturating_mul(2) <= share
}

/// What the broker at the other end of a link believes it may still push for the
/// stream, had every push it sent arrived.
pub(super) fn believed(seen: &LinkStream) -> u64 {
    seen.reported
        .map_or(0, |(share, received)| u64::from(share) + received)
        .saturating_sub(seen.received)
}

/// Whether broker `node`, linked, believes it may push nothing more for stream `id`.
pub(super) fn told_no_credit(
    links: &HashMap<NodeId, LinkEntry>,
    node: NodeId,
    id: StreamId,
) -> bool {
    links
        .get(&node)
        .is_some_and(|l| l.streams.get(&id).is_none_or(|seen| believed(seen) == 0))
}

/// The rotation with which [`split`] gives `node` the first unit of the remainder,
/// if it gets any at all.
pub(super) fn first_place(nodes: &[NodeId], weights: &[u32], node: NodeId) -> Option<usize> {
    let all = weights.iter().all(|&w| w == 0);
    nodes
        .iter()
        .zip(weights)
        .filter(|(_, &w)| all || w > 0)
        .position(|(&n, _)| n == node)
}

/// Splits `free` between links in proportion to `weights` (the partitions each
/// leads); when all are zero (no leader known, or none among the linked brokers),
/// equally. The remainder of the
/// division goes one by one to links with weight, from `rotate` on, so none of it
/// is lost and it does not always go to the same link: with little credit and many
/// brokers, that link would be the only one ever pushing.
pub(super) fn split(free: u32, weights: &[u32], rotate: usize) -> Vec<u32> {
    let weights: Vec<u64> = if weights.iter().all(|&w| w == 0) {
        vec![1; weights.len()]
    } else {
        weights.iter().map(|&w| u64::from(w)).collect()
    };
    let total: u64 = weights.iter().sum();
    if total == 0 {
        return Vec::new();
    }
    let mut shares: Vec<u32> = weights
        .iter()
        .map(|&w| u32::try_from(u64::from(free) * w / total).unwrap_or(0))
        .collect();
    let given: u32 = shares.iter().sum();
    let eligible: Vec<usize> = (0..weights.len()).filter(|&i| weights[i] > 0).collect();
    for k in 0..free.saturating_sub(given) {
        let i = eligible[rotate.wrapping_add(k as usize) % eligible.len()];
        shares[i] += 1;
    }
    shares
}

/// A client's share of its stream's spare room: `percent` of its credit, rounded up.
pub(super) fn spare_share(credit: u32, percent: u32) -> u32 {
    u32::try_from((u64::from(credit) * u64::from(percent)).div_ceil(100)).unwrap_or(u32::MAX)
}
