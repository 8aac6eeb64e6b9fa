//! Every CPU instruction-set path (portable, AVX2+FMA, AVX-512, AVX-512 BF16) against the
//! reference, on fresh random inputs: tile-breaking lengths (1, 17, 113, 1023), Sq ≠ Sk, head
//! dims that are not multiples of a vector, GQA, varlen, every mask option, fully masked rows,
//! every dtype, forward and backward. A path this CPU lacks is skipped with a printed reason
//! (CI machines without AVX-512 still run the portable and AVX2 paths).

mod common;
use candle_core::{DType, Device};
use candle_flash::cpu::{with_cpu_isa, CpuIsa};
use common::{check_case, Case};

fn cases() -> Vec<(Case, bool)> {
    let mut cases = vec![];
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (sq, sk) in [(1, 1), (17, 113), (113, 17), (1, 1023)] {
            cases.push((Case::new(dtype, (sq, sk), (4, 2), 64).causal(), true));
        }
        for d in [1, 8, 40, 72, 128] {
            cases.push((Case::new(dtype, (33, 70), (3, 1), d), true));
        }
        cases.push((Case::new(dtype, (130, 130), (2, 2), 64).window(Some(7), Some(3)).softcap(5.0), true));
        cases.push((Case::new(dtype, (65, 200), (4, 4), 32).causal().alibi(2), true));
        cases.push((Case::new(dtype, (40, 8), (2, 2), 32).causal(), true)); // rows that see no key
        cases.push((Case::new(dtype, (16, 64), (2, 1), 32).window(Some(0), Some(0)), true));
        let seqs = [(17, 30), (0, 5), (64, 64), (113, 1), (1, 70)];
        cases.push((Case::new(dtype, (0, 0), (4, 2), 64).varlen(&seqs).causal(), true));
    }
    cases.push((Case::new(DType::F32, (1023, 1023), (2, 1), 64).causal(), false));
    cases.push((Case::new(DType::BF16, (1023, 1023), (2, 2), 64), false));
    cases
}

#[test]
fn every_isa_matches_the_reference() {
    for isa in CpuIsa::ALL {
        if isa > CpuIsa::detected() {
            println!("skipping {isa:?}: this CPU has at most {:?}", CpuIsa::detected());
            continue;
        }
        for (case, with_grad) in cases() {
            let (used, summary) = with_cpu_isa(isa, || check_case(&case, &Device::Cpu, with_grad));
            assert_eq!(used, isa);
            let summary = summary.unwrap_or_else(|e| panic!("{isa:?} {case:?}: {e}"));
            println!("{isa:?} {case:?}: {summary}");
        }
    }
}

/// The environment variable lowers the set and never raises it.
#[test]
fn parse_names() {
    assert_eq!(CpuIsa::parse("AVX2"), Some(CpuIsa::Avx2));
    assert_eq!(CpuIsa::parse("avx512bf16"), Some(CpuIsa::Avx512Bf16));
    assert_eq!(CpuIsa::parse("sse"), None);
    assert!(CpuIsa::active() <= CpuIsa::detected());
}
