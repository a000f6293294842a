//! From a GGUF file to a cluster's stage plan, as a head takes that path: parse the file,
//! read the hyper-parameters, weigh each layer and end (`model_cost`), plan over a few
//! nodes (`baton_plan::partition`, and an even `--split`), and list the tensors each
//! planned stage would read (`stage_tensor_sources`). A hostile file, or a worker's
//! hostile copy of one, goes through all of it before anything reaches ggml.
//!
//! The input's first 8 bytes describe the cluster: byte 0 the node count (1 to 4) and
//! the context size (bits 4..7: 2^(6 + n) cells); bytes 1 to 7 each node's memory (a
//! power of two from 1 MiB) and speed. The rest is the GGUF file, written to a scratch
//! file and opened the way every node opens a model (`ModelFile::open`: mapped).
//!
//! Checked: nothing panics (overflows included: fuzz builds check them); a file whose
//! header and hyper-parameters parse in memory opens from disk too, with the same
//! hyper-parameters; the cost has one entry per layer; a plan covers every layer
//! exactly once, in order, on nodes that were offered.
#![no_main]

use std::path::PathBuf;

use baton_gguf::Gguf;
use baton_model::{HParams, ModelFile, StageSpan};
use baton_plan::{NodeOffer, Plan};
use libfuzzer_sys::fuzz_target;

/// One scratch file per fuzzing process.
fn scratch() -> PathBuf {
    std::env::temp_dir().join(format!("baton-fuzz-stage-plan-{}.gguf", std::process::id()))
}

fn offers(cluster: &[u8; 8]) -> (Vec<NodeOffer>, usize) {
    let n_nodes = usize::from(cluster[0] & 0b11) + 1;
    let n_ctx = 1usize << (6 + (cluster[0] >> 4) % 8);
    let nodes = cluster[1..1 + n_nodes]
        .iter()
        .enumerate()
        .map(|(i, &b)| {
            NodeOffer::single(
                format!("node{i}"),
                1u64 << (20 + (b & 0x1f)),
                1e-4 * f64::from(1 + (b >> 5)),
            )
        })
        .collect();
    (nodes, n_ctx)
}

/// Every layer exactly once, in order, from the first stage to the last.
fn check_plan(plan: &Plan, n_layer: usize, nodes: &[NodeOffer]) {
    let mut next = 0;
    for stage in &plan.stages {
        assert_eq!(stage.layers.start, next, "{plan:?}");
        assert!(stage.layers.end >= stage.layers.start, "{plan:?}");
        assert!(stage.node < nodes.len(), "{plan:?}");
        next = stage.layers.end;
    }
    assert_eq!(next, n_layer, "{plan:?}");
}

fuzz_target!(|data: &[u8]| {
    let Some((cluster, bytes)) = data.split_first_chunk::<8>() else {
        return;
    };
    // Garbage stops here, without touching the disk.
    let Ok(gguf) = Gguf::parse(bytes) else { return };
    let Ok(hparams) = HParams::from_gguf(&gguf) else { return };
    let path = scratch();
    std::fs::write(&path, bytes).expect("the scratch file is writable");
    let file = ModelFile::open(&path).expect("a file whose header and hyper-parameters parse opens");
    assert_eq!(file.hparams(), &hparams);
    let n_layer = hparams.n_layer;

    let (nodes, n_ctx) = offers(cluster);
    let cost = baton_cluster::model_cost(&file, n_ctx, 0, Default::default());
    assert_eq!(cost.layer_bytes.len(), n_layer);
    let mut plans = Vec::new();
    if let Ok(plan) = baton_plan::partition(&cost, &nodes) {
        plans.push(plan);
    }
    let even: Vec<usize> = (0..nodes.len())
        .map(|i| n_layer / nodes.len() + usize::from(i < n_layer % nodes.len()))
        .collect();
    if let Ok(plan) = baton_plan::plan_with_split(&cost, &nodes, &even) {
        plans.push(plan);
    }
    for plan in &plans {
        check_plan(plan, n_layer, &nodes);
        let n = plan.stages.len();
        for (i, stage) in plan.stages.iter().enumerate() {
            let span = StageSpan {
                layers: stage.layers.clone(),
                first: i == 0,
                last: i + 1 == n,
            };
            let _ = baton_model::stage_tensor_sources(&file, &span);
        }
    }
});
