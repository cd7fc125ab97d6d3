//! Reader behaviour on real files: every byte checked against the file's
//! seeded random content, on every backend and file system available here
//! (O_DIRECT on a real file system, buffered on tmpfs), with priorities,
//! cancellation, injected faults and truncated files. No timing assertions.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use colibri_io::{
    Completion, Extent, FaultInjector, FaultRule, FileId, IoBackendChoice, IoError, Priority,
    ReadErrorKind, ReadRequest, Reader, ReaderConfig, Ticket, completion_channel,
};
use common::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const FILE_LEN: usize = 3 * 1024 * 1024 + 1234; // not a multiple of any alignment

fn config(backend: IoBackendChoice, queue_depth: usize) -> ReaderConfig {
    ReaderConfig {
        backend,
        queue_depth,
        ..ReaderConfig::default()
    }
}

fn extent(file: u32, offset: u64, len: u64) -> Extent {
    Extent {
        file: FileId(file),
        offset,
        len,
    }
}

fn check_bytes(done: &Completion, content: &[&[u8]], extents: &[Extent], context: &str) {
    let ranges = done
        .result
        .as_ref()
        .unwrap_or_else(|e| panic!("{context}: request {} failed: {e}", done.tag));
    assert_eq!(ranges.len(), extents.len(), "{context}");
    for (i, e) in extents.iter().enumerate() {
        let want = &content[e.file.0 as usize][e.offset as usize..(e.offset + e.len) as usize];
        let got = done.extent_bytes(i).expect("extent bytes");
        assert!(
            got == want,
            "{context}: tag {} extent {i} ({e:?}) differs from the file",
            done.tag
        );
    }
}

/// Offsets and lengths that are unaligned, cross 512/4096 boundaries,
/// touch the first and last byte, and end exactly at end of file.
fn tricky_extents(file_len: u64, seed: u64) -> Vec<(u64, u64)> {
    let mut v = vec![
        (0, 1),
        (1, 1),
        (4095, 2),
        (4095, 4097),
        (511, 513),
        (8191, 1),
        (12_288, 4096),
        (100_000, 300_000),
        (file_len - 1, 1),
        (file_len - 5000, 5000),
        (0, file_len),
    ];
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for _ in 0..40 {
        let offset = rng.random_range(0..file_len - 1);
        let len = rng.random_range(1..=(file_len - offset).min(700_000));
        v.push((offset, len));
    }
    v
}

#[test]
fn unaligned_extents_read_exact_bytes_everywhere() {
    for place in places() {
        let content = random_bytes(7, FILE_LEN);
        let path = write_file(place.dir.path(), "data.bin", &content);
        let files = place.open(&[&path]);
        for backend in backends() {
            let context = format!("{} / {backend}", place.label);
            let arena = arena(FILE_LEN + 8192, 8);
            let reader = Reader::new(
                Arc::clone(&files),
                std::slice::from_ref(&arena),
                config(backend, 8),
            )
            .expect("reader");
            let (reply, completions) = completion_channel();
            let extents = tricky_extents(FILE_LEN as u64, 11);
            // Submit in waves of 8 (one slot each), checking every byte.
            for wave in extents.chunks(8) {
                let batch: Vec<ReadRequest> = wave
                    .iter()
                    .enumerate()
                    .map(|(i, &(offset, len))| ReadRequest {
                        slot: arena.try_acquire().expect("slot"),
                        extents: vec![extent(0, offset, len)],
                        priority: if i % 2 == 0 {
                            Priority::Demand
                        } else {
                            Priority::Prefetch
                        },
                        tag: i as u64,
                    })
                    .collect();
                reader.submit(batch, &reply).expect("submit");
                for done in collect(&completions, wave.len()) {
                    let (offset, len) = wave[done.tag as usize];
                    check_bytes(&done, &[&content], &[extent(0, offset, len)], &context);
                }
            }
            let c = reader.counters();
            assert_eq!(c.requests_completed, extents.len() as u64, "{context}");
            assert_eq!(c.requests_failed + c.requests_cancelled, 0, "{context}");
            assert_eq!((c.reads_queued, c.reads_in_kernel), (0, 0), "{context}");
            assert!(c.bytes_read >= c.bytes_delivered, "{context}");
            assert_eq!(arena.free_slots(), 8, "{context}: every slot returned");
            eprintln!("ok: {context}: {:?}", reader.backend());
        }
    }
}

#[test]
fn one_request_gathers_extents_of_several_files() {
    for place in places() {
        let a = random_bytes(21, 200_000);
        let b = random_bytes(22, 300_001);
        let pa = write_file(place.dir.path(), "a.bin", &a);
        let pb = write_file(place.dir.path(), "b.bin", &b);
        let files = place.open(&[&pa, &pb]);
        for backend in backends() {
            let arena = arena(1 << 20, 2);
            let reader = Reader::new(
                Arc::clone(&files),
                std::slice::from_ref(&arena),
                config(backend, 4),
            )
            .expect("reader");
            let extents = vec![
                extent(0, 10, 5000),
                extent(1, 4097, 100_000),
                extent(0, 199_000, 1000),
                extent(1, 0, 0),
                extent(1, 300_000, 1),
            ];
            let done = reader
                .read_blocking(ReadRequest {
                    slot: arena.try_acquire().expect("slot"),
                    extents: extents.clone(),
                    priority: Priority::Demand,
                    tag: 0,
                })
                .expect("read");
            check_bytes(
                &done,
                &[&a, &b],
                &extents,
                &format!("{} / {backend}", place.label),
            );
        }
    }
}

#[test]
fn long_extents_are_cut_into_several_reads() {
    for place in places() {
        let content = random_bytes(31, FILE_LEN);
        let path = write_file(place.dir.path(), "long.bin", &content);
        let files = place.open(&[&path]);
        for backend in backends() {
            let arena = arena(FILE_LEN + 8192, 1);
            let reader = Reader::new(
                Arc::clone(&files),
                std::slice::from_ref(&arena),
                ReaderConfig {
                    max_read_bytes: 64 * 1024,
                    ..config(backend, 4)
                },
            )
            .expect("reader");
            let extents = vec![extent(0, 777, FILE_LEN as u64 - 777)];
            let done = reader
                .read_blocking(ReadRequest {
                    slot: arena.try_acquire().expect("slot"),
                    extents: extents.clone(),
                    priority: Priority::Demand,
                    tag: 0,
                })
                .expect("read");
            check_bytes(
                &done,
                &[&content],
                &extents,
                &format!("{} / {backend}", place.label),
            );
        }
    }
}

/// Submits `prefetch` prefetch requests then `demand` demand requests (in
/// that order) and returns their completions by ticket.
fn run_mixed(
    reader: &Reader,
    arena: &Arc<colibri_io::PinnedArena>,
    prefetch: usize,
    demand: usize,
    hold_between: bool,
) -> (
    Vec<Ticket>,
    Vec<Ticket>,
    HashMap<Ticket, Completion>,
    Vec<Ticket>,
) {
    let (reply, completions) = completion_channel();
    let make = |i: usize, priority| ReadRequest {
        slot: arena.try_acquire().expect("slot"),
        extents: vec![extent(0, (i as u64) * 65_536 + 3, 60_000)],
        priority,
        tag: i as u64,
    };
    let (p, d) = if hold_between {
        let hold = reader.hold().expect("hold");
        let p = reader
            .submit(
                (0..prefetch).map(|i| make(i, Priority::Prefetch)).collect(),
                &reply,
            )
            .expect("submit");
        let d = reader
            .submit(
                (prefetch..prefetch + demand)
                    .map(|i| make(i, Priority::Demand))
                    .collect(),
                &reply,
            )
            .expect("submit");
        drop(hold);
        (p, d)
    } else {
        let mut batch: Vec<ReadRequest> =
            (0..prefetch).map(|i| make(i, Priority::Prefetch)).collect();
        batch.extend((prefetch..prefetch + demand).map(|i| make(i, Priority::Demand)));
        let tickets = reader.submit(batch, &reply).expect("submit");
        (tickets[..prefetch].to_vec(), tickets[prefetch..].to_vec())
    };
    let done = collect(&completions, prefetch + demand);
    let order: Vec<Ticket> = done.iter().map(|c| c.ticket).collect();
    let by_ticket = done.into_iter().map(|c| (c.ticket, c)).collect();
    (p, d, by_ticket, order)
}

#[test]
fn demand_is_issued_before_prefetch_submitted_earlier() {
    for place in places() {
        let content = random_bytes(41, 64 * 65_536);
        let path = write_file(place.dir.path(), "prio.bin", &content);
        let files = place.open(&[&path]);
        for backend in backends() {
            for (queue_depth, hold_between) in [(1, false), (2, false), (4, true), (1, true)] {
                let context = format!(
                    "{} / {backend} / qd {queue_depth} / hold {hold_between}",
                    place.label
                );
                let arena = arena(128 * 1024, 60);
                let reader = Reader::new(
                    Arc::clone(&files),
                    std::slice::from_ref(&arena),
                    config(backend, queue_depth),
                )
                .expect("reader");
                let (prefetch, demand, done, order) =
                    run_mixed(&reader, &arena, 40, 12, hold_between);
                for c in done.values() {
                    let e = extent(0, c.tag * 65_536 + 3, 60_000);
                    check_bytes(c, &[&content], &[e], &context);
                }
                let seq = |t: &Ticket| done[t].issue_seq.expect("issued");
                let last_demand = demand.iter().map(seq).max().expect("demand");
                let first_prefetch = prefetch.iter().map(seq).min().expect("prefetch");
                assert!(
                    last_demand < first_prefetch,
                    "{context}: a prefetch read was issued (seq {first_prefetch}) before a demand \
                     read (seq {last_demand})"
                );
                // Demand requests keep their submission order among themselves.
                let demand_seqs: Vec<u64> = demand.iter().map(seq).collect();
                assert!(demand_seqs.windows(2).all(|w| w[0] < w[1]), "{context}");
                if queue_depth == 1 {
                    // One read at a time: completions come in issue order.
                    let first_demand_done = order.iter().take(demand.len()).collect::<Vec<_>>();
                    assert!(
                        first_demand_done.iter().all(|t| demand.contains(t)),
                        "{context}: at depth 1 all demand requests complete first"
                    );
                }
            }
        }
    }
}

#[test]
fn prefetch_reads_are_limited_to_their_share_of_the_queue() {
    // With a prefetch limit of 1 (of 4 places), prefetch reads are issued
    // one at a time, so they must complete in exactly their issue order;
    // demand reads still use the whole depth and go first.
    let Some(place) = direct_place().or_else(tmpfs_place) else {
        return;
    };
    let content = random_bytes(43, 64 * 65_536);
    let path = write_file(place.dir.path(), "share.bin", &content);
    let files = place.open(&[&path]);
    for backend in backends() {
        let arena = arena(128 * 1024, 60);
        let reader = Reader::new(
            Arc::clone(&files),
            std::slice::from_ref(&arena),
            ReaderConfig {
                prefetch_limit: Some(1),
                ..config(backend, 4)
            },
        )
        .expect("reader");
        assert_eq!(reader.backend().prefetch_limit, 1);
        let (reply, completions) = completion_channel();
        let batch: Vec<ReadRequest> = (0..35)
            .map(|i| ReadRequest {
                slot: arena.try_acquire().expect("slot"),
                extents: vec![extent(0, i * 65_536, 65_536)],
                priority: if i < 30 {
                    Priority::Prefetch
                } else {
                    Priority::Demand
                },
                tag: i,
            })
            .collect();
        reader.submit(batch, &reply).expect("submit");
        let done = collect(&completions, 35);
        for c in &done {
            let e = extent(0, c.tag * 65_536, 65_536);
            check_bytes(c, &[&content], &[e], &format!("{backend}"));
        }
        let mut demand_seqs: Vec<u64> = done
            .iter()
            .filter(|c| c.priority == Priority::Demand)
            .filter_map(|c| c.issue_seq)
            .collect();
        demand_seqs.sort();
        assert_eq!(demand_seqs, vec![0, 1, 2, 3, 4], "{backend}: demand first");
        let prefetch_seqs: Vec<u64> = done
            .iter()
            .filter(|c| c.priority == Priority::Prefetch)
            .filter_map(|c| c.issue_seq)
            .collect();
        assert_eq!(prefetch_seqs.len(), 30);
        assert!(
            prefetch_seqs.windows(2).all(|w| w[0] < w[1]),
            "{backend}: more than one prefetch read was in flight: {prefetch_seqs:?}"
        );
    }
}

#[test]
fn a_promoted_prefetch_request_is_issued_with_demand_priority() {
    // Everything is queued under a hold, so the issue order is decided by
    // priorities alone: the promoted request goes after the demand reads
    // already queued and before every other prefetch read.
    let Some(place) = direct_place().or_else(tmpfs_place) else {
        return;
    };
    let content = random_bytes(47, 16 * 65_536);
    let path = write_file(place.dir.path(), "promote.bin", &content);
    let files = place.open(&[&path]);
    for backend in backends() {
        let arena = arena(128 * 1024, 16);
        let reader = Reader::new(
            Arc::clone(&files),
            std::slice::from_ref(&arena),
            config(backend, 1),
        )
        .expect("reader");
        let (reply, completions) = completion_channel();
        let request = |i: u64, priority| ReadRequest {
            slot: arena.try_acquire().expect("slot"),
            extents: vec![extent(0, i * 65_536, 65_536)],
            priority,
            tag: i,
        };
        let hold = reader.hold().expect("hold");
        let first = reader
            .submit(vec![request(0, Priority::Demand)], &reply)
            .expect("submit");
        let prefetch = reader
            .submit(
                (1..9).map(|i| request(i, Priority::Prefetch)).collect(),
                &reply,
            )
            .expect("submit");
        // Promote one prefetch request; a demand and an unknown ticket are
        // ignored.
        reader
            .promote(&[prefetch[5], first[0], Ticket(9_999)])
            .expect("promote");
        let later = reader
            .submit(vec![request(9, Priority::Demand)], &reply)
            .expect("submit");
        drop(hold);
        let done: HashMap<Ticket, Completion> = collect(&completions, 10)
            .into_iter()
            .map(|c| (c.ticket, c))
            .collect();
        for c in done.values() {
            let e = extent(0, c.tag * 65_536, 65_536);
            check_bytes(c, &[&content], &[e], &format!("{backend}"));
        }
        let seq = |t: &Ticket| done[t].issue_seq.expect("issued");
        assert_eq!(seq(&first[0]), 0, "{backend}");
        assert_eq!(
            seq(&prefetch[5]),
            1,
            "{backend}: promoted after queued demand"
        );
        assert_eq!(
            seq(&later[0]),
            2,
            "{backend}: later demand after the promoted"
        );
        for (i, t) in prefetch.iter().enumerate().filter(|(i, _)| *i != 5) {
            assert!(seq(t) > 2, "{backend}: prefetch {i} before demand");
        }
        assert_eq!(done[&prefetch[5]].priority, Priority::Demand, "{backend}");
        let counters = reader.counters();
        assert_eq!(counters.requests_promoted, 1, "{backend}");
        assert_eq!(counters.reads_promoted, 1, "{backend}");
        // Promoting a finished request changes nothing.
        reader.promote(&[prefetch[0]]).expect("promote");
        assert_eq!(reader.counters().requests_promoted, 1, "{backend}");
        assert!(reader.counters().busy_ns > 0, "{backend}: reads took time");
    }
}

#[test]
fn cancelled_requests_complete_once_and_return_their_slots() {
    for place in places() {
        let content = random_bytes(51, 64 * 65_536);
        let path = write_file(place.dir.path(), "cancel.bin", &content);
        let files = place.open(&[&path]);
        for backend in backends() {
            let context = format!("{} / {backend}", place.label);
            let arena = arena(128 * 1024, 64);
            let reader = Reader::new(
                Arc::clone(&files),
                std::slice::from_ref(&arena),
                config(backend, 4),
            )
            .expect("reader");
            let (reply, completions) = completion_channel();
            let make = |i: u64| ReadRequest {
                slot: arena.try_acquire().expect("slot"),
                extents: vec![extent(0, i * 65_536 + 17, 65_000)],
                priority: if i.is_multiple_of(3) {
                    Priority::Demand
                } else {
                    Priority::Prefetch
                },
                tag: i,
            };
            // Part 1: cancelled while queued (held): never issued.
            let hold = reader.hold().expect("hold");
            let tickets = reader
                .submit((0..20).map(make).collect(), &reply)
                .expect("submit");
            let cancelled: Vec<Ticket> = tickets.iter().copied().step_by(2).collect();
            reader.cancel(&cancelled).expect("cancel");
            drop(hold);
            for c in collect(&completions, 20) {
                if cancelled.contains(&c.ticket) {
                    assert!(
                        matches!(c.result, Err(IoError::Cancelled)),
                        "{context}: {:?}",
                        c.result
                    );
                    assert_eq!(
                        c.issue_seq, None,
                        "{context}: a cancelled queued request was issued"
                    );
                } else {
                    check_bytes(
                        &c,
                        &[&content],
                        &[extent(0, c.tag * 65_536 + 17, 65_000)],
                        &context,
                    );
                }
            }
            // Part 2: cancelled while possibly in the kernel: each completes
            // exactly once, either with correct data or as cancelled.
            let tickets = reader
                .submit((20..60).map(make).collect(), &reply)
                .expect("submit");
            reader.cancel(&tickets).expect("cancel");
            reader
                .cancel(&tickets)
                .expect("cancelling twice is harmless");
            let mut seen = std::collections::HashSet::new();
            let mut outcomes = (0, 0);
            for c in collect(&completions, 40) {
                assert!(
                    seen.insert(c.ticket),
                    "{context}: two completions for one ticket"
                );
                match &c.result {
                    Ok(_) => {
                        outcomes.0 += 1;
                        check_bytes(
                            &c,
                            &[&content],
                            &[extent(0, c.tag * 65_536 + 17, 65_000)],
                            &context,
                        );
                    }
                    Err(IoError::Cancelled) => outcomes.1 += 1,
                    Err(e) => panic!("{context}: unexpected error {e}"),
                }
            }
            assert!(
                completions.try_recv().is_err(),
                "{context}: extra completion"
            );
            let c = reader.counters();
            assert_eq!(c.requests_cancelled, 10 + outcomes.1, "{context}");
            assert_eq!(c.requests_completed, 10 + outcomes.0, "{context}");
            assert_eq!((c.reads_queued, c.reads_in_kernel), (0, 0), "{context}");
            assert_eq!(arena.free_slots(), 64, "{context}: every slot returned");
            eprintln!(
                "{context}: in-flight cancel: {} finished, {} cancelled",
                outcomes.0, outcomes.1
            );
        }
    }
}

fn read_all_with_faults(
    place: &Place,
    path: &Path,
    content: &[u8],
    backend: IoBackendChoice,
    faults: &FaultInjector,
    requests: u64,
) -> (Vec<Completion>, colibri_io::CounterSnapshot) {
    let files = place.open(&[path]);
    let arena = arena(256 * 1024, requests as usize);
    let reader = Reader::new(
        files,
        std::slice::from_ref(&arena),
        ReaderConfig {
            faults: Some(faults.clone()),
            ..config(backend, 4)
        },
    )
    .expect("reader");
    let (reply, completions) = completion_channel();
    let batch = (0..requests)
        .map(|i| ReadRequest {
            slot: arena.try_acquire().expect("slot"),
            extents: vec![extent(0, i * 100_000 + 1, 150_000)],
            priority: Priority::Demand,
            tag: i,
        })
        .collect();
    reader.submit(batch, &reply).expect("submit");
    let mut done = collect(&completions, requests as usize);
    done.sort_by_key(|c| c.tag);
    let _ = content;
    (done, reader.counters())
}

#[test]
fn injected_short_reads_are_completed_by_resubmission() {
    for place in places() {
        let content = random_bytes(61, 1_200_000);
        let path = write_file(place.dir.path(), "short.bin", &content);
        for backend in backends() {
            let context = format!("{} / {backend}", place.label);
            let faults = FaultInjector::new();
            faults.add(FaultRule::short_file(&path));
            let (done, counters) =
                read_all_with_faults(&place, &path, &content, backend, &faults, 8);
            for c in &done {
                check_bytes(
                    c,
                    &[&content],
                    &[extent(0, c.tag * 100_000 + 1, 150_000)],
                    &context,
                );
            }
            assert!(
                counters.short_reads_resubmitted >= 8,
                "{context}: {counters:?}"
            );
            assert_eq!(counters.requests_completed, 8, "{context}");
            assert!(faults.fired() >= 8, "{context}");
        }
    }
}

#[test]
fn injected_eio_fails_one_request_with_file_offset_and_length() {
    for place in places() {
        let content = random_bytes(71, 1_200_000);
        let path = write_file(place.dir.path(), "eio.bin", &content);
        for backend in backends() {
            let context = format!("{} / {backend}", place.label);
            let faults = FaultInjector::new();
            faults.add(FaultRule::fail_nth_read(3, libc::EIO));
            let (done, counters) =
                read_all_with_faults(&place, &path, &content, backend, &faults, 8);
            let failed: Vec<&Completion> = done.iter().filter(|c| c.result.is_err()).collect();
            assert_eq!(failed.len(), 1, "{context}");
            let c = failed[0];
            match &c.result {
                Err(
                    error @ IoError::Read {
                        path: p,
                        offset,
                        len,
                        kind,
                        errno,
                    },
                ) => {
                    assert_eq!(p, &path, "{context}");
                    assert_eq!(*offset, c.tag * 100_000 + 1, "{context}");
                    assert_eq!(*len, 150_000, "{context}");
                    assert_eq!(*kind, ReadErrorKind::Media, "{context}");
                    assert_eq!(*errno, libc::EIO, "{context}");
                    let message = error.to_string();
                    assert!(message.contains(&path.display().to_string()), "{message}");
                    assert!(message.contains(&offset.to_string()), "{message}");
                    eprintln!("{context}: {message}");
                }
                other => panic!("{context}: expected a read error, got {other:?}"),
            }
            for c in done.iter().filter(|c| c.result.is_ok()) {
                check_bytes(
                    c,
                    &[&content],
                    &[extent(0, c.tag * 100_000 + 1, 150_000)],
                    &context,
                );
            }
            assert_eq!(
                (counters.requests_failed, counters.requests_completed),
                (1, 7),
                "{context}"
            );
        }
    }
}

#[test]
fn interrupted_reads_are_retried() {
    let Some(place) = direct_place().or_else(tmpfs_place) else {
        return;
    };
    let content = random_bytes(81, 1_200_000);
    let path = write_file(place.dir.path(), "eintr.bin", &content);
    for backend in backends() {
        let faults = FaultInjector::new();
        faults.add(FaultRule::fail_nth_read(1, libc::EINTR));
        faults.add(FaultRule::fail_nth_read(2, libc::EAGAIN));
        let (done, counters) = read_all_with_faults(&place, &path, &content, backend, &faults, 4);
        for c in &done {
            check_bytes(
                c,
                &[&content],
                &[extent(0, c.tag * 100_000 + 1, 150_000)],
                &format!("{backend}"),
            );
        }
        assert_eq!(counters.reads_retried, 2, "{backend}");
    }
}

#[test]
fn faults_by_file_fail_only_that_file() {
    let Some(place) = direct_place().or_else(tmpfs_place) else {
        return;
    };
    let a = random_bytes(91, 300_000);
    let b = random_bytes(92, 300_000);
    let pa = write_file(place.dir.path(), "good.bin", &a);
    let pb = write_file(place.dir.path(), "bad.bin", &b);
    let files = place.open(&[&pa, &pb]);
    for backend in backends() {
        let faults = FaultInjector::new();
        faults.add(FaultRule::fail_file(&pb, libc::ENXIO));
        let arena = arena(64 * 1024, 8);
        let reader = Reader::new(
            Arc::clone(&files),
            std::slice::from_ref(&arena),
            ReaderConfig {
                faults: Some(faults),
                ..config(backend, 4)
            },
        )
        .expect("reader");
        let (reply, completions) = completion_channel();
        let batch = (0..8)
            .map(|i| ReadRequest {
                slot: arena.try_acquire().expect("slot"),
                extents: vec![extent((i % 2) as u32, i * 10_000, 20_000)],
                priority: Priority::Demand,
                tag: i,
            })
            .collect();
        reader.submit(batch, &reply).expect("submit");
        for c in collect(&completions, 8) {
            if c.tag % 2 == 0 {
                check_bytes(
                    &c,
                    &[&a, &b],
                    &[extent(0, c.tag * 10_000, 20_000)],
                    &format!("{backend}"),
                );
            } else {
                match &c.result {
                    Err(IoError::Read {
                        path,
                        kind: ReadErrorKind::DeviceGone,
                        ..
                    }) => assert_eq!(path, &pb),
                    other => panic!("{backend}: expected ENXIO on bad.bin, got {other:?}"),
                }
            }
        }
    }
}

#[test]
fn truncated_file_is_an_error_naming_it_and_unlinked_file_still_reads() {
    for place in places() {
        let content = random_bytes(101, 1_000_000);
        for backend in backends() {
            let context = format!("{} / {backend}", place.label);
            let path = write_file(place.dir.path(), &format!("trunc-{backend}.bin"), &content);
            let files = place.open(&[&path]);
            let arena = arena(256 * 1024, 4);
            let reader = Reader::new(
                Arc::clone(&files),
                std::slice::from_ref(&arena),
                config(backend, 4),
            )
            .expect("reader");
            let read = |offset: u64, len: u64| {
                reader
                    .read_blocking(ReadRequest {
                        slot: arena.try_acquire().expect("slot"),
                        extents: vec![extent(0, offset, len)],
                        priority: Priority::Demand,
                        tag: offset,
                    })
                    .expect("reader alive")
            };
            // Before truncation: fine, including the last byte.
            check_bytes(
                &read(999_000, 1000),
                &[&content],
                &[extent(0, 999_000, 1000)],
                &context,
            );
            // An extent past the end never reads zeros.
            let c = read(1_000_000 - 100, 200);
            assert!(
                matches!(&c.result, Err(IoError::UnexpectedEof { path: p, .. }) if p == &path),
                "{context}: {:?}",
                c.result
            );
            // Truncate mid-run (another process replacing a model file).
            std::fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .and_then(|f| f.set_len(500_001))
                .expect("truncate");
            for (offset, len) in [(600_000u64, 1000u64), (499_000, 5000), (500_001, 1)] {
                let c = read(offset, len);
                match &c.result {
                    Err(
                        error @ IoError::UnexpectedEof {
                            path: p,
                            offset: o,
                            len: l,
                            file_len,
                        },
                    ) => {
                        assert_eq!(
                            (p, *o, *l, *file_len),
                            (&path, offset, len, 500_001),
                            "{context}"
                        );
                        assert!(error.to_string().contains("truncated"), "{error}");
                    }
                    other => {
                        panic!("{context}: reading {offset}+{len} after truncation gave {other:?}")
                    }
                }
            }
            // What is still there still reads correctly.
            check_bytes(
                &read(400_000, 100_001),
                &[&content],
                &[extent(0, 400_000, 100_001)],
                &context,
            );
            // A file unlinked under us keeps its content while we hold it open.
            std::fs::remove_file(&path).expect("unlink");
            check_bytes(
                &read(12_345, 54_321),
                &[&content],
                &[extent(0, 12_345, 54_321)],
                &context,
            );
            let c = reader.counters();
            assert_eq!(c.requests_failed, 4, "{context}");
        }
    }
}

#[test]
fn both_backends_return_identical_bytes() {
    let backends = backends();
    if backends.len() < 2 {
        eprintln!("SKIP (backend comparison): only one backend available here");
        return;
    }
    for place in places() {
        let content = random_bytes(111, FILE_LEN);
        let path = write_file(place.dir.path(), "same.bin", &content);
        let files = place.open(&[&path]);
        let extents = tricky_extents(FILE_LEN as u64, 5);
        let mut results: Vec<Vec<Vec<u8>>> = Vec::new();
        for &backend in &backends {
            let arena = arena(FILE_LEN + 8192, 4);
            let reader = Reader::new(
                Arc::clone(&files),
                std::slice::from_ref(&arena),
                config(backend, 4),
            )
            .expect("reader");
            let mut out = Vec::new();
            for &(offset, len) in &extents {
                let c = reader
                    .read_blocking(ReadRequest {
                        slot: arena.try_acquire().expect("slot"),
                        extents: vec![extent(0, offset, len)],
                        priority: Priority::Demand,
                        tag: 0,
                    })
                    .expect("read");
                out.push(c.extent_bytes(0).expect("ok").to_vec());
            }
            results.push(out);
        }
        assert!(results.windows(2).all(|w| w[0] == w[1]), "{}", place.label);
        for (bytes, &(offset, len)) in results[0].iter().zip(&extents) {
            assert_eq!(
                bytes.as_slice(),
                &content[offset as usize..(offset + len) as usize]
            );
        }
    }
}

#[test]
fn requests_that_cannot_be_planned_fail_at_once() {
    let Some(place) = direct_place().or_else(tmpfs_place) else {
        return;
    };
    let content = random_bytes(121, 100_000);
    let path = write_file(place.dir.path(), "plan.bin", &content);
    let files = place.open(&[&path]);
    let arena = arena(4096, 2);
    let reader = Reader::new(
        files,
        std::slice::from_ref(&arena),
        config(IoBackendChoice::Auto, 2),
    )
    .expect("reader");
    // 4096 bytes starting at 1 need two aligned blocks under O_DIRECT.
    let too_big = if place.direct {
        extent(0, 1, 4096)
    } else {
        extent(0, 0, 4097)
    };
    let c = reader
        .read_blocking(ReadRequest {
            slot: arena.try_acquire().expect("slot"),
            extents: vec![too_big],
            priority: Priority::Demand,
            tag: 0,
        })
        .expect("reader alive");
    assert!(
        matches!(c.result, Err(IoError::SlotTooSmall { .. })),
        "{:?}",
        c.result
    );
    drop(c);
    let c = reader
        .read_blocking(ReadRequest {
            slot: arena.try_acquire().expect("slot"),
            extents: vec![extent(7, 0, 10)],
            priority: Priority::Demand,
            tag: 0,
        })
        .expect("reader alive");
    assert!(
        matches!(c.result, Err(IoError::UnknownFile(7))),
        "{:?}",
        c.result
    );
    drop(c);
    assert_eq!(arena.free_slots(), 2);
}

#[test]
fn dropping_the_reader_with_reads_in_flight_cancels_them() {
    for place in places() {
        let content = random_bytes(131, 64 * 65_536);
        let path = write_file(place.dir.path(), "drop.bin", &content);
        let files = place.open(&[&path]);
        for backend in backends() {
            let context = format!("{} / {backend}", place.label);
            let arena = arena(128 * 1024, 48);
            let reader = Reader::new(
                Arc::clone(&files),
                std::slice::from_ref(&arena),
                config(backend, 4),
            )
            .expect("reader");
            let (reply, completions) = completion_channel();
            let batch = (0..48)
                .map(|i| ReadRequest {
                    slot: arena.try_acquire().expect("slot"),
                    extents: vec![extent(0, i * 65_536, 65_536)],
                    priority: Priority::Prefetch,
                    tag: i,
                })
                .collect();
            reader.submit(batch, &reply).expect("submit");
            drop(reader);
            let done = collect(&completions, 48);
            for c in &done {
                match &c.result {
                    Ok(_) => check_bytes(
                        c,
                        &[&content],
                        &[extent(0, c.tag * 65_536, 65_536)],
                        &context,
                    ),
                    Err(IoError::Cancelled) => {}
                    Err(e) => panic!("{context}: {e}"),
                }
            }
            drop(done);
            assert_eq!(arena.free_slots(), 48, "{context}");
        }
    }
}

#[test]
fn uring_reports_registered_files_and_buffers_where_the_probe_allows() {
    let probe = colibri_io::probe_uring();
    eprintln!("io_uring probe: {probe:?}");
    if let Some(reason) = &probe.unavailable {
        eprintln!("SKIP (io_uring features): {reason}");
        let Some(place) = direct_place().or_else(tmpfs_place) else {
            return;
        };
        let path = write_file(place.dir.path(), "x.bin", &random_bytes(1, 4096));
        let error = Reader::new(open(&[&path]), &[], config(IoBackendChoice::Uring, 1))
            .expect_err("io_uring required but unavailable");
        assert!(matches!(error, IoError::UringUnavailable { .. }));
        let reader =
            Reader::new(open(&[&path]), &[], config(IoBackendChoice::Auto, 1)).expect("auto");
        assert_eq!(reader.backend().backend, colibri_io::Backend::Pread);
        assert!(reader.backend().fallback_reason.is_some());
        return;
    }
    let Some(place) = direct_place().or_else(tmpfs_place) else {
        return;
    };
    let path = write_file(place.dir.path(), "x.bin", &random_bytes(1, 4096));
    let arena = arena(4096, 2);
    let reader =
        Reader::new(open(&[&path]), &[arena], config(IoBackendChoice::Auto, 1)).expect("auto");
    let info = reader.backend();
    assert_eq!(info.backend, colibri_io::Backend::Uring);
    assert_eq!(info.registered_files, probe.register_files);
    if probe.read_fixed && probe.register_buffers {
        assert!(info.registered_buffers, "{info:?}");
    } else {
        eprintln!(
            "SKIP (registered buffers): the probe says READ_FIXED or registration is unsupported"
        );
    }
    assert_eq!(info.async_cancel, probe.async_cancel);
    let pread = Reader::new(open(&[&path]), &[], config(IoBackendChoice::Pread, 1)).expect("pread");
    assert_eq!(pread.backend().backend, colibri_io::Backend::Pread);
    assert_eq!(pread.backend().fallback_reason, None);
}

#[test]
fn cancelling_a_request_with_a_read_in_the_kernel_discards_that_read() {
    // Request A is one small read; request B is one long extent cut into
    // many 64 KiB reads issued one after another. When A's completion
    // arrives, B has a read in the kernel (the reader refills before it
    // waits), so cancelling B must discard a read already in flight and
    // still hand B's slot back exactly once.
    for place in places() {
        let content = random_bytes(141, 16 << 20);
        let path = write_file(place.dir.path(), "inflight.bin", &content);
        let files = place.open(&[&path]);
        for backend in backends() {
            let context = format!("{} / {backend}", place.label);
            let arena = arena(16 << 20, 2);
            let reader = Reader::new(
                Arc::clone(&files),
                std::slice::from_ref(&arena),
                ReaderConfig {
                    max_read_bytes: 64 * 1024,
                    ..config(backend, 2)
                },
            )
            .expect("reader");
            let (reply, completions) = completion_channel();
            let a = ReadRequest {
                slot: arena.try_acquire().expect("slot"),
                extents: vec![extent(0, 5, 4000)],
                priority: Priority::Demand,
                tag: 0,
            };
            let b = ReadRequest {
                slot: arena.try_acquire().expect("slot"),
                extents: vec![extent(0, 0, (16 << 20) - 4096)],
                priority: Priority::Demand,
                tag: 1,
            };
            let tickets = reader.submit(vec![a, b], &reply).expect("submit");
            let first = collect(&completions, 1).pop().expect("one");
            assert_eq!(
                first.ticket, tickets[0],
                "{context}: A is one read, B is 256"
            );
            check_bytes(&first, &[&content], &[extent(0, 5, 4000)], &context);
            reader.cancel(&tickets[1..]).expect("cancel");
            let second = collect(&completions, 1).pop().expect("one");
            assert_eq!(second.ticket, tickets[1]);
            assert!(
                matches!(second.result, Err(IoError::Cancelled)),
                "{context}: B finished all 256 reads before the cancel arrived: {:?}",
                second.result
            );
            assert!(second.issue_seq.is_some(), "{context}: B had started");
            drop((first, second));
            let c = reader.counters();
            // One or two of B's reads were in the kernel (queue depth 2).
            assert!((1..=2).contains(&c.reads_discarded), "{context}: {c:?}");
            // What they transferred (if the kernel finished them rather
            // than cancelling) is counted as read, at most one 64 KiB read
            // each.
            assert!(
                c.bytes_discarded <= c.reads_discarded * (64 << 10)
                    && c.bytes_discarded <= c.bytes_read,
                "{context}: {c:?}"
            );
            assert_eq!((c.reads_queued, c.reads_in_kernel), (0, 0), "{context}");
            assert_eq!(arena.free_slots(), 2, "{context}");
            assert!(
                completions.try_recv().is_err(),
                "{context}: exactly one completion each"
            );
        }
    }
}

#[test]
fn files_that_refuse_o_direct_fall_back_to_buffered_reads() {
    // procfs refuses O_DIRECT at open on every kernel: a real file system
    // that takes the fallback without any configuration.
    let path = Path::new("/proc/version");
    let expected = std::fs::read(path).expect("read /proc/version");
    let files =
        Arc::new(colibri_io::FileSet::open(&[path], colibri_io::DirectIo::Auto).expect("open"));
    let info = files.infos().next().expect("one").clone();
    assert!(!info.direct, "{info:?}");
    assert_eq!(info.alignment, colibri_io::Alignment::BUFFERED);
    eprintln!(
        "/proc/version: {}",
        info.buffered_reason.as_deref().unwrap_or("")
    );
    for backend in backends() {
        let arena = arena(4096, 1);
        let reader = Reader::new(
            Arc::clone(&files),
            std::slice::from_ref(&arena),
            config(backend, 2),
        )
        .expect("reader");
        let len = expected.len() as u64 - 3;
        let c = reader
            .read_blocking(ReadRequest {
                slot: arena.try_acquire().expect("slot"),
                extents: vec![extent(0, 3, len)],
                priority: Priority::Demand,
                tag: 0,
            })
            .expect("reader alive");
        assert_eq!(c.extent_bytes(0), Some(&expected[3..]), "{backend}");
    }
}

#[test]
fn many_threads_submit_mixed_priorities_concurrently() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Reader>();
    assert_send_sync::<colibri_io::Slot>();
    for place in places() {
        let content = Arc::new(random_bytes(151, FILE_LEN));
        let path = write_file(place.dir.path(), "threads.bin", &content);
        let files = place.open(&[&path]);
        for backend in backends() {
            let context = format!("{} / {backend}", place.label);
            let arena = arena(256 * 1024, 32);
            let reader = Arc::new(
                Reader::new(
                    Arc::clone(&files),
                    std::slice::from_ref(&arena),
                    config(backend, 16),
                )
                .expect("reader"),
            );
            let workers: Vec<_> = (0..4u64)
                .map(|worker| {
                    let reader = Arc::clone(&reader);
                    let arena = Arc::clone(&arena);
                    let content = Arc::clone(&content);
                    let context = context.clone();
                    std::thread::spawn(move || {
                        let (reply, completions) = completion_channel();
                        let mut rng = ChaCha8Rng::seed_from_u64(worker);
                        for _round in 0..10 {
                            let mut wanted = HashMap::new();
                            let batch: Vec<ReadRequest> = (0..8u64)
                                .map(|i| {
                                    let len = rng.random_range(1..200_000u64);
                                    let offset = rng.random_range(0..FILE_LEN as u64 - len);
                                    wanted.insert(i, (offset, len));
                                    ReadRequest {
                                        slot: arena
                                            .acquire_timeout(std::time::Duration::from_secs(60))
                                            .expect("slot"),
                                        extents: vec![extent(0, offset, len)],
                                        priority: if rng.random_bool(0.5) {
                                            Priority::Demand
                                        } else {
                                            Priority::Prefetch
                                        },
                                        tag: i,
                                    }
                                })
                                .collect();
                            reader.submit(batch, &reply).expect("submit");
                            for done in collect(&completions, 8) {
                                let (offset, len) = wanted[&done.tag];
                                check_bytes(
                                    &done,
                                    &[&content],
                                    &[extent(0, offset, len)],
                                    &context,
                                );
                            }
                        }
                    })
                })
                .collect();
            for worker in workers {
                worker.join().expect("worker");
            }
            let c = reader.counters();
            assert_eq!(c.requests_completed, 320, "{context}");
            assert_eq!((c.reads_queued, c.reads_in_kernel), (0, 0), "{context}");
        }
    }
}
