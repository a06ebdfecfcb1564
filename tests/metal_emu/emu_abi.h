// C ABI between an emulated kernel (compiled with metal_shim.h) and emu_runtime.cpp.
#pragma once
#include <cstdint>

extern "C" {

// One kernel argument buffer, as MLX passes it: data plus optional shape/strides/ndim.
struct EmuBuffer {
  void* data;
  const int32_t* shape;
  const int64_t* strides;
  int32_t ndim;
};

// Every Metal thread-position attribute MLX's metal_kernel can declare.
struct EmuThreadIds {
  uint32_t thread_position_in_grid[3];
  uint32_t thread_position_in_threadgroup[3];
  uint32_t threadgroup_position_in_grid[3];
  uint32_t threadgroups_per_grid[3];
  uint32_t threads_per_grid[3];
  uint32_t grid_size[3];
  uint32_t grid_origin[3];
  uint32_t threads_per_threadgroup[3];
  uint32_t dispatch_threads_per_threadgroup[3];
  uint32_t thread_index_in_threadgroup;
  uint32_t thread_index_in_simdgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t simdgroups_per_threadgroup;
  uint32_t dispatch_simdgroups_per_threadgroup;
  uint32_t threads_per_simdgroup;
  uint32_t thread_execution_width;
  uint32_t thread_index_in_quadgroup;
  uint32_t quadgroup_index_in_threadgroup;
  uint32_t quadgroups_per_threadgroup;
  uint32_t dispatch_quadgroups_per_threadgroup;
};

// What a SIMD-group operation sees once every live lane of its simdgroup arrived.
struct EmuSimdView {
  uint64_t slots[32];  // each lane's posted value (raw bytes, little-endian)
  uint32_t active;     // bit i set: lane i posted
  uint32_t lane;       // the calling lane
};

enum EmuSimdOp {
  EMU_SIMD_SUM = 1,
  EMU_SIMD_PRODUCT,
  EMU_SIMD_MAX,
  EMU_SIMD_MIN,
  EMU_SIMD_SHUFFLE,
  EMU_SIMD_SHUFFLE_XOR,
  EMU_SIMD_SHUFFLE_UP,
  EMU_SIMD_SHUFFLE_DOWN,
  EMU_SIMD_BROADCAST,
  EMU_SIMD_ANY,
  EMU_SIMD_ALL,
  EMU_SIMD_BARRIER,
};

// Implemented by the runtime.
// `line`: the call site, so threads meeting at different barriers / SIMD ops are reported.
void emu_threadgroup_barrier(int line);
const EmuSimdView* emu_simd_exchange(int op, const void* value, int nbytes, int line);
void* emu_threadgroup_alloc(int site, unsigned long size, unsigned long align);
[[noreturn]] void emu_fail(const char* message);

// Implemented by the generated translation unit: run one Metal thread.
void emu_kernel_thread(const EmuBuffer* buffers, const EmuThreadIds* ids);
}
