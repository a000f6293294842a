//! A stage keeps resident only the weights of its own layers.

mod common;

use baton_model::{mapped_rss, ModelFile, Stage, StageConfig, StageSpan};
use common::{model, QWEN2};

#[test]
fn a_third_of_the_layers_is_resident_for_about_a_third_of_the_layer_bytes() {
    for repack in [false, true] {
        check_middle_third(repack);
    }
}

fn check_middle_third(repack: bool) {
    let path = model(QWEN2);
    let file = ModelFile::open(&path).unwrap();
    let n_layer = file.hparams().n_layer;
    let all_layers: u64 = (0..n_layer).map(|l| file.layer_bytes(l)).sum();
    let middle = n_layer / 3..2 * n_layer / 3;
    let own: u64 = middle.clone().map(|l| file.layer_bytes(l)).sum();
    // Parsing the header touched its pages (metadata and tensor index: a few MB).
    let baseline = mapped_rss(file.map_address()).expect("smaps reports the mapping");

    let span = StageSpan {
        layers: middle,
        first: false,
        last: false,
    };
    let config = StageConfig {
        n_ctx: 64,
        n_threads: 2,
        repack,
        n_seq: 0,
    };
    let mut stage = Stage::load(file.clone(), span, &config).unwrap();
    if !repack {
        assert_eq!(
            mapped_rss(file.map_address()),
            Some(baseline),
            "loading alone reads no weights"
        );
    }
    // Run hidden states through it so every weight it owns is touched.
    let hidden = vec![0.01f32; file.hparams().n_embd * 4];
    let batch = baton_model::Batch {
        input: baton_model::StageInput::Hidden(&hidden),
        positions: &[0, 1, 2, 3],
        seq_ids: &[0; 4],
        logit_rows: &[],
    };
    stage.forward(&batch).unwrap();

    // Weights are either mapped pages or repacked copies (whose pages were released).
    let repacked = stage.weights().repacked_bytes() as u64;
    let resident = mapped_rss(file.map_address()).unwrap() - baseline + repacked;
    let ratio = resident as f64 / all_layers as f64;
    println!("repack {repack}: stage resident {resident} bytes ({repacked} repacked), own layers {own}, all layers {all_layers}, ratio {ratio:.3}");
    assert!(
        resident as f64 >= 0.95 * own as f64,
        "resident {resident} < own layer bytes {own}"
    );
    assert!(
        resident as f64 <= 1.10 * own as f64,
        "resident {resident} far above own {own}"
    );
    assert!(stage.resident_bytes() >= resident);
}
