//! Tests of `l2_prefetch`: the launch plan and the CPU backend (a no-op that checks its buffer).

use super::*;
use crate::{Backend, bf16};

#[test]
fn the_plan_caps_rounds_down_to_16_and_gives_each_thread_one_chunk() {
    // Hand-computed: the whole 35B-A3B o_proj (2048 x 4096 BF16 = 16 MiB) is 1024 chunks.
    assert_eq!(
        plan(16 << 20, usize::MAX),
        Plan {
            bytes: 16 << 20,
            chunks: 1024,
            blocks: 32
        }
    );
    // A cap below the buffer, not a multiple of 16: 40009 -> 40000 bytes, 3 chunks (16384,
    // 16384, 7232), one block.
    assert_eq!(
        plan(1 << 20, 40_009),
        Plan {
            bytes: 40_000,
            chunks: 3,
            blocks: 1
        }
    );
    // 33 chunks need a second block.
    assert_eq!(plan(33 * CHUNK, usize::MAX).blocks, 2);
    assert_eq!(plan(32 * CHUNK, usize::MAX).blocks, 1);
    // Nothing under 16 bytes, and a zero cap, launch nothing.
    for (len, cap) in [
        (15, usize::MAX),
        (1 << 20, 0),
        (0, usize::MAX),
        (1 << 20, 15),
    ] {
        assert_eq!(
            plan(len, cap),
            Plan {
                bytes: 0,
                chunks: 0,
                blocks: 0
            },
            "{len} bytes, cap {cap}"
        );
    }
}

proptest::proptest! {
    /// The chunks cover exactly the bytes asked for: every chunk starts below `bytes`, the
    /// threads of the grid cover every chunk, and `bytes` never passes the buffer or the cap.
    #[test]
    fn the_plan_covers_exactly_the_capped_range(len in 0usize..1 << 26, cap in 0usize..1 << 27) {
        let p = plan(len, cap);
        proptest::prop_assert!(p.bytes <= len.min(cap));
        proptest::prop_assert!(len.min(cap) - p.bytes < 16);
        proptest::prop_assert_eq!(p.bytes % 16, 0);
        proptest::prop_assert!(p.chunks * CHUNK >= p.bytes);
        proptest::prop_assert!(p.chunks == 0 || (p.chunks - 1) * CHUNK < p.bytes);
        proptest::prop_assert!(p.blocks * BLOCK_THREADS >= p.chunks);
        proptest::prop_assert!(p.blocks == 0 || (p.blocks - 1) * BLOCK_THREADS < p.chunks);
    }
}

#[test]
fn on_the_cpu_it_changes_nothing_and_has_no_budget() {
    let be = Backend::cpu();
    let v: Vec<bf16> = (0..100).map(|i| bf16::from_f32(i as f32)).collect();
    let b = be.upload(&v).expect("upload");
    for cap in [0, 16, 17, 200, usize::MAX] {
        run(&be, &b, cap).expect("prefetch");
    }
    assert_eq!(be.download(&b).expect("download"), v);
    assert_eq!(budget(&be), 0);
}
