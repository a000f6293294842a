//! The mean of a sequence's rows, computed as llama.cpp pools embeddings: one product of
//! the transposed rows with a column of `1/n`, so the mean's bits are libllama's.

use baton_ggml::{Allocator, Context, CpuBackend, DType};

use crate::ModelError;

/// The mean of `n_rows` rows of `n_embd` values (`rows` row-major by token), as
/// llama.cpp's `build_pooling` computes it for `LLAMA_POOLING_TYPE_MEAN`:
/// `mul_mat(cont(transpose(rows)), mean)` with `mean` a column of `1.0f / n_rows`, on
/// the CPU with `n_threads` threads (each output is one dot product over the rows, the
/// same whatever the threads).
pub fn mean_rows(rows: &[f32], n_embd: usize, n_threads: usize) -> Result<Vec<f32>, ModelError> {
    let n_rows = rows.len() / n_embd.max(1);
    if n_embd == 0 || n_rows == 0 || rows.len() != n_rows * n_embd {
        return Err(ModelError::BadBatch(format!(
            "{} values are not whole rows of {n_embd}",
            rows.len()
        )));
    }
    let ctx = Context::new(8, 8);
    let input = ctx
        .new_tensor(DType::F32, &[n_embd as i64, n_rows as i64])
        .named("pool_rows")
        .set_input();
    let weights = ctx
        .new_tensor(DType::F32, &[n_rows as i64, 1])
        .named("pool_mean")
        .set_input();
    let mean = ctx
        .mul_mat(ctx.cont(ctx.transpose(input)), weights)
        .named("pooled")
        .set_output(); // [n_embd, 1]
    let mut graph = ctx.new_graph();
    graph.expand(mean);
    let mut allocator = Allocator::new_cpu();
    allocator.alloc(&graph)?;
    input.write(rows)?;
    weights.write(&vec![1.0f32 / n_rows as f32; n_rows])?;
    CpuBackend::new(n_threads.max(1)).compute(&graph)?;
    let mut out = vec![0f32; n_embd];
    mean.read(&mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mean_of_rows_is_their_average() {
        let rows = [1.0, 2.0, 3.0, 3.0, 4.0, 5.0];
        assert_eq!(mean_rows(&rows, 3, 1).unwrap(), vec![2.0, 3.0, 4.0]);
        let one = [0.25, -1.5];
        assert_eq!(mean_rows(&one, 2, 2).unwrap(), vec![0.25, -1.5]);
        assert!(mean_rows(&rows, 4, 1).is_err(), "rows must be whole");
        assert!(mean_rows(&[], 4, 1).is_err(), "an empty sequence has no mean");
    }
}
