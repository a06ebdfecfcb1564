// DFlash 2 candidate-selector walk: kernel BODY for mx.fast.metal_kernel.
//
// Launch (kernels.py): grid = (32 * NSG, B, 1) threads, threadgroup = (32 * NSG, 1, 1):
// one threadgroup per batch row walks the whole block. Template: TOPK (candidates per
// position), RANK (codebook rank), NSG (simdgroups). The header defines
// DFLASH_SELECTOR_SAMPLE: 0 = greedy, 1 = sampling (adds the temperature and uniforms
// inputs and the q output).
// Inputs: unary [B, P, TOPK] f32, cand [B, P, TOPK] i32, g [B, P, RANK] f32,
//   pred_codebook [V, RANK], succ_codebook [V, RANK] (any float dtype), anchor [B] i32,
//   (sampling) temperature scalar f32, uniforms [B, P] f32.
// Outputs: path [B, P] i32, index [B, P] i32, (sampling) q [B, P, TOPK] f32.
//
// Per position t (sequential): simdgroup s scores candidates j = s, s + NSG, ... with its
// lanes splitting the rank and a simd_sum, s_j = unary[t, j] + sum_r (PC[pred, r] * g[t, r])
// * SC[cand[t, j], r]; then simdgroup 0 picks j (greedy: argmax, lowest index on ties;
// sampling: q = softmax(s / T), first j with cumsum(q)[j] > u[t], else TOPK - 1) and
// broadcasts pred = cand[t, j] through threadgroup memory.
const uint b = threadgroup_position_in_grid.y;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const int P = unary_shape[1];
constexpr int NR = (RANK + 31) / 32;

threadgroup float scores[TOPK];
threadgroup int chosen;
#if DFLASH_SELECTOR_SAMPLE
threadgroup float probs[TOPK];
const float temp = temperature;
#endif

int pred = anchor[b];
for (int t = 0; t < P; ++t) {
  const size_t bt = size_t(b) * size_t(P) + size_t(t);

  // This lane's slice of PC[pred] * g[t].
  float pg[NR];
  for (int i = 0; i < NR; ++i) {
    const int r = int(lane) + 32 * i;
    pg[i] = (r < RANK)
        ? float(pred_codebook[size_t(pred) * RANK + r]) * g[bt * RANK + r]
        : 0.0f;
  }

  // Scores: one simdgroup per candidate, lanes over the rank.
  for (int j = int(sg); j < TOPK; j += NSG) {
    const size_t row = size_t(cand[bt * TOPK + j]) * RANK;
    float acc = 0.0f;
    for (int i = 0; i < NR; ++i) {
      const int r = int(lane) + 32 * i;
      if (r < RANK) {
        acc += pg[i] * float(succ_codebook[row + r]);
      }
    }
    acc = simd_sum(acc);
    if (lane == 0) {
      scores[j] = unary[bt * TOPK + j] + acc;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // Selection by simdgroup 0.
  if (sg == 0) {
    int best;
#if DFLASH_SELECTOR_SAMPLE
    float m_local = -INFINITY;
    for (int j = int(lane); j < TOPK; j += 32) {
      m_local = max(m_local, scores[j] / temp);
    }
    const float m = simd_max(m_local);
    float z_local = 0.0f;
    for (int j = int(lane); j < TOPK; j += 32) {
      const float e = exp(scores[j] / temp - m);
      probs[j] = e;
      z_local += e;
    }
    const float z = simd_sum(z_local);
    for (int j = int(lane); j < TOPK; j += 32) {
      const float qv = probs[j] / z;
      probs[j] = qv;
      q[bt * TOPK + j] = qv;
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
    const float u = uniforms[bt];
    float c = 0.0f;
    best = TOPK - 1;
    for (int j = 0; j < TOPK; ++j) {
      c += probs[j];
      if (c > u) {
        best = j;
        break;
      }
    }
#else
    float bv = -INFINITY;
    int bi = TOPK;
    for (int j = int(lane); j < TOPK; j += 32) {
      const float v = scores[j];
      if (bi == TOPK || v > bv) {
        bv = v;
        bi = j;
      }
    }
    const float m = simd_max(bv);
    best = simd_min((bi < TOPK && bv == m) ? bi : TOPK);
    if (best >= TOPK) {
      best = 0;
    }
#endif
    if (lane == 0) {
      const int tok = cand[bt * TOPK + best];
      path[bt] = tok;
      index[bt] = best;
      chosen = tok;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  pred = chosen;
}
