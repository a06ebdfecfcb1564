// DFlash 2 grouped dynamic causal conv: kernel BODY for mx.fast.metal_kernel.
//
// Launch (kernels.py): grid = (H, L, B) threads, threadgroup = (min(H, 256), 1, 1);
// one thread per output element. Template: T = activation dtype.
// Inputs (all dtype T, row contiguous): x [B, L, H], base [K, H], dyn [B, L, K, G].
// Output: out [B, L, H] (T).
//
// For each tap in order: acc = acc + base[tap] * xs; acc = acc + dyn[tap] * xs, where
// xs = x[t - tap] (0 for t < tap: taps never cross the block start) and dyn's group
// coefficient covers H / G contiguous channels. The fp32 accumulation uses exactly the
// operation order of reference.dynamic_conv (products rounded before each add; no fma
// contraction), so fp32 results are bit-identical.
#pragma STDC FP_CONTRACT OFF
const uint h = thread_position_in_grid.x;
const uint t = thread_position_in_grid.y;
const uint b = thread_position_in_grid.z;
const int L = x_shape[1];
const int H = x_shape[2];
const int K = base_shape[0];
const int G = dyn_shape[3];
if (h >= uint(H) || t >= uint(L)) {
  return;
}
const uint gs = uint(H / G);
const size_t row = size_t(b) * size_t(L) + size_t(t);
float acc = 0.0f;
for (int tap = 0; tap < K; ++tap) {
  const float xv = (int(t) >= tap) ? float(x[(row - size_t(tap)) * size_t(H) + h]) : 0.0f;
  const float pb = float(base[size_t(tap) * size_t(H) + h]) * xv;
  acc = acc + pb;
  const float pd = float(dyn[(row * size_t(K) + size_t(tap)) * size_t(G) + h / gs]) * xv;
  acc = acc + pd;
}
out[row * size_t(H) + h] = static_cast<T>(acc);
