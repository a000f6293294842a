//! The worker's self-benchmark: seconds per layer for one generated token.

use std::path::Path;
use std::time::Instant;

use baton_ggml::Device;
use baton_model::{Batch, LogitReply, ModelFile, Stage, StageConfig, StageInput, StageSpan};

use crate::NodeError;

/// Times single-token steps through one middle layer of the model at `path`, on `device`.
pub fn measure(path: &Path, threads: usize, device: Device) -> Result<f32, NodeError> {
    let file = ModelFile::open(path)?;
    let width = file.hparams().hidden_width();
    let layer = file.hparams().n_layer / 2;
    let span = StageSpan {
        layers: layer..layer + 1,
        first: false,
        last: false,
    };
    let mut stage = Stage::load_on(file, span, &StageConfig::new(64, threads), device)?;
    let hidden = vec![0.01f32; width];
    let mut step = |pos: i32| {
        let batch = Batch {
            input: StageInput::Hidden(&hidden),
            positions: &[pos],
            seq_ids: &[0],
            logit_rows: &[],
            decode: false,
        };
        stage.forward(&batch, LogitReply::Logits).map(|_| ())
    };
    // The first step faults the layer's weights in; time the ones after it. Other
    // processes only ever slow a round down, so the fastest of a few rounds is the
    // measurement least disturbed by whatever else the machine was doing.
    step(0)?;
    const STEPS: i32 = 8;
    const ROUNDS: i32 = 4;
    let mut best = f32::INFINITY;
    for round in 0..ROUNDS {
        let start = Instant::now();
        for pos in 1..=STEPS {
            step(round * STEPS + pos)?;
        }
        best = best.min(start.elapsed().as_secs_f32() / STEPS as f32);
    }
    Ok(best)
}
