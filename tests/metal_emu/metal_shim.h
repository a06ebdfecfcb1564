// metal_shim.h: the subset of the Metal Shading Language that dflash-mac kernels use,
// for compiling MLX custom-kernel sources with g++ (see docs/kernels.md).
//
// Deliberately small: anything not defined here (vector types beyond uint2/uint3, atomics,
// simd_prefix_*, quad_*, metal::fast/precise, textures, ...) fails to compile. No C/C++
// math header is included, so a kernel cannot silently call a host function instead of a
// Metal built-in; math comes from compiler builtins.
#pragma once

#include <cstddef>
#include <cstdint>

#include "emu_abi.h"

// ---- address spaces ---------------------------------------------------------------------
// `threadgroup` is lowered by emulate.py: variable declarations become EMU_THREADGROUP_VAR
// (a per-threadgroup arena, poisoned at each threadgroup start); pointer/reference
// qualifiers are dropped. `device`, `constant` and `thread` carry no meaning on the CPU.
#define device
#define constant
#define thread
#define kernel
namespace emu {
template <class T>
using ident = T;
template <class T>
inline T& threadgroup_var(int site) {
  return *static_cast<T*>(emu_threadgroup_alloc(site, sizeof(T), alignof(T)));
}
}  // namespace emu
#define EMU_THREADGROUP_VAR(name, site, ...) \
  emu::ident<__VA_ARGS__>& name = emu::threadgroup_var<__VA_ARGS__>(site)

// ---- scalar and vector types ------------------------------------------------------------
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;

struct uint2 {
  uint x, y;
};
struct uint3 {
  uint x, y, z;
};

namespace emu {
template <class To, class From>
inline To bit_cast(const From& f) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast size");
  To t;
  __builtin_memcpy(&t, &f, sizeof(To));
  return t;
}

inline uint16_t f32_to_f16(float f) {  // round to nearest even
  uint32_t x = bit_cast<uint32_t>(f);
  uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
  if (ax >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // >= 65520 -> inf
  if (ax < 0x38800000u) {  // half subnormal or zero: round at 2^-24 via float addition
    float v = bit_cast<float>(ax) + 0.5f;
    return uint16_t(sign | (bit_cast<uint32_t>(v) - 0x3f000000u));
  }
  ax += 0xfffu + ((ax >> 13) & 1u);
  return uint16_t(sign | ((ax - 0x38000000u) >> 13));
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {
    float v = float(m) * 5.9604644775390625e-08f;  // m * 2^-24, exact
    return bit_cast<float>(bit_cast<uint32_t>(v) | sign);
  }
  if (e == 31) return bit_cast<float>(sign | 0x7f800000u | (m << 13));
  return bit_cast<float>(sign | ((e + 112u) << 23) | (m << 13));
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even
  uint32_t x = bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);
  return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

inline float bf16_to_f32(uint16_t b) { return bit_cast<float>(uint32_t(b) << 16); }
}  // namespace emu

// half and bfloat: storage types converting through float with one rounding per result.
// Arithmetic follows Metal's promotion: (h op h) -> h, (h op int) -> h, (h op float) ->
// float. Mixing with double (an unsuffixed literal) does not compile: Metal has no double.
#define EMU_FLOAT16_TYPE(NAME, TO16, FROM16)                                           \
  struct NAME {                                                                        \
    uint16_t bits;                                                                     \
    NAME() = default;                                                                  \
    NAME(float f) : bits(emu::TO16(f)) {}                                              \
    NAME(int i) : bits(emu::TO16(float(i))) {}                                         \
    NAME(uint i) : bits(emu::TO16(float(i))) {}                                        \
    operator float() const { return emu::FROM16(bits); }                               \
    NAME operator-() const { return NAME(-float(*this)); }                             \
    NAME& operator+=(NAME o) { return *this = NAME(float(*this) + float(o)); }         \
    NAME& operator-=(NAME o) { return *this = NAME(float(*this) - float(o)); }         \
    NAME& operator*=(NAME o) { return *this = NAME(float(*this) * float(o)); }         \
    NAME& operator/=(NAME o) { return *this = NAME(float(*this) / float(o)); }         \
  };
EMU_FLOAT16_TYPE(half, f32_to_f16, f16_to_f32)
EMU_FLOAT16_TYPE(bfloat, f32_to_bf16, bf16_to_f32)
#undef EMU_FLOAT16_TYPE

#define EMU_BINOP(T, OP)                                                           \
  inline T operator OP(T a, T b) { return T(float(a) OP float(b)); }               \
  inline T operator OP(T a, int b) { return T(float(a) OP float(b)); }             \
  inline T operator OP(int a, T b) { return T(float(a) OP float(b)); }             \
  inline float operator OP(T a, float b) { return float(a) OP b; }                 \
  inline float operator OP(float a, T b) { return a OP float(b); }
#define EMU_CMPOP(T, OP)                                                           \
  inline bool operator OP(T a, T b) { return float(a) OP float(b); }               \
  inline bool operator OP(T a, int b) { return float(a) OP float(b); }             \
  inline bool operator OP(int a, T b) { return float(a) OP float(b); }             \
  inline bool operator OP(T a, float b) { return float(a) OP b; }                  \
  inline bool operator OP(float a, T b) { return a OP float(b); }
#define EMU_OPS(T) \
  EMU_BINOP(T, +) EMU_BINOP(T, -) EMU_BINOP(T, *) EMU_BINOP(T, /) \
  EMU_CMPOP(T, ==) EMU_CMPOP(T, !=) EMU_CMPOP(T, <) EMU_CMPOP(T, >) \
  EMU_CMPOP(T, <=) EMU_CMPOP(T, >=)
EMU_OPS(half)
EMU_OPS(bfloat)
#undef EMU_OPS
#undef EMU_CMPOP
#undef EMU_BINOP

typedef half float16_t;   // as MLX's utils.h
typedef bfloat bfloat16_t;

#define INFINITY (__builtin_inff())
#define NAN (__builtin_nanf(""))
#define FLT_MAX (3.40282347e+38f)
#define FLT_MIN (1.17549435e-38f)
#define INT_MAX (2147483647)
#define INT_MIN (-2147483647 - 1)
#define UINT_MAX (4294967295u)

namespace metal {

// ---- math -------------------------------------------------------------------------------
inline float exp(float x) { return __builtin_expf(x); }
inline float exp2(float x) { return __builtin_exp2f(x); }
inline float log(float x) { return __builtin_logf(x); }
inline float log2(float x) { return __builtin_log2f(x); }
inline float sqrt(float x) { return __builtin_sqrtf(x); }
inline float rsqrt(float x) { return 1.0f / __builtin_sqrtf(x); }
inline float tanh(float x) { return __builtin_tanhf(x); }
inline float floor(float x) { return __builtin_floorf(x); }
inline float ceil(float x) { return __builtin_ceilf(x); }
inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline float abs(float x) { return __builtin_fabsf(x); }
inline float fabs(float x) { return __builtin_fabsf(x); }
inline float fmax(float a, float b) { return __builtin_fmaxf(a, b); }
inline float fmin(float a, float b) { return __builtin_fminf(a, b); }
inline float max(float a, float b) { return __builtin_fmaxf(a, b); }
inline float min(float a, float b) { return __builtin_fminf(a, b); }
inline bool isnan(float x) { return __builtin_isnan(x); }
inline bool isinf(float x) { return __builtin_isinf(x); }
inline half exp(half x) { return half(exp(float(x))); }
inline half max(half a, half b) { return half(max(float(a), float(b))); }
inline half min(half a, half b) { return half(min(float(a), float(b))); }
inline int abs(int x) { return x < 0 ? -x : x; }
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline uint max(uint a, uint b) { return a > b ? a : b; }
inline uint min(uint a, uint b) { return a < b ? a : b; }
template <class T>
inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <class T>
inline T select(T a, T b, bool c) { return c ? b : a; }

template <class T>
struct numeric_limits;
template <>
struct numeric_limits<float> {
  static constexpr float infinity() { return __builtin_inff(); }
  static constexpr float max() { return 3.40282347e+38f; }
  static constexpr float lowest() { return -3.40282347e+38f; }
  static constexpr float min() { return 1.17549435e-38f; }
  static constexpr float epsilon() { return 1.1920929e-07f; }
};
template <>
struct numeric_limits<int> {
  static constexpr int max() { return 2147483647; }
  static constexpr int lowest() { return -2147483647 - 1; }
  static constexpr int min() { return -2147483647 - 1; }
};
template <>
struct numeric_limits<uint> {
  static constexpr uint max() { return 4294967295u; }
  static constexpr uint lowest() { return 0u; }
  static constexpr uint min() { return 0u; }
};

// ---- synchronisation ---------------------------------------------------------------------
enum class mem_flags : uint { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(uint(a) | uint(b)); }

// The defaulted `line` records the call site (a divergent barrier is an error).
inline void threadgroup_barrier(mem_flags, int line = __builtin_LINE()) {
  emu_threadgroup_barrier(line);
}
inline void simdgroup_barrier(mem_flags, int line = __builtin_LINE()) {
  emu_simd_exchange(EMU_SIMD_BARRIER, nullptr, 0, line);
}

// ---- SIMD-group functions (32 lanes; only lanes that posted take part) -------------------
namespace detail {
template <class T>
struct simd_type {  // the types SIMD ops accept
  static constexpr bool ok = false;
};
#define EMU_SIMD_TYPE(T, LOWEST) \
  template <>                    \
  struct simd_type<T> {          \
    static constexpr bool ok = true; \
    static T lowest() { return LOWEST; } \
    static T highest() { return -(LOWEST); } \
  };
EMU_SIMD_TYPE(float, -__builtin_inff())
EMU_SIMD_TYPE(half, half(-__builtin_inff()))
EMU_SIMD_TYPE(bfloat, bfloat(-__builtin_inff()))
EMU_SIMD_TYPE(int, -2147483647)
#undef EMU_SIMD_TYPE
template <>
struct simd_type<uint> {
  static constexpr bool ok = true;
  static uint lowest() { return 0u; }
  static uint highest() { return 4294967295u; }
};
template <>
struct simd_type<bool> {
  static constexpr bool ok = true;
};

template <class T>
inline const EmuSimdView* post(int op, T x, int line) {
  static_assert(simd_type<T>::ok, "SIMD-group op on a type the Metal shim does not support");
  return emu_simd_exchange(op, &x, int(sizeof(T)), line);
}
template <class T>
inline T slot(const EmuSimdView* v, uint lane) {
  T out;
  if (lane < 32 && ((v->active >> lane) & 1u)) {
    __builtin_memcpy(&out, &v->slots[lane], sizeof(T));
  } else {  // inactive or out-of-range lane: undefined on Metal, poison here
    __builtin_memset(&out, 0xff, sizeof(T));
  }
  return out;
}
template <class T, class F>
inline T tree(const EmuSimdView* v, T identity, F f) {  // butterfly order, same on all lanes
  T vals[32];
  for (uint i = 0; i < 32; ++i) vals[i] = ((v->active >> i) & 1u) ? slot<T>(v, i) : identity;
  for (uint off = 16; off >= 1; off >>= 1)
    for (uint i = 0; i < off; ++i) vals[i] = f(vals[i], vals[i + off]);
  return vals[0];
}
}  // namespace detail

template <class T>
inline T simd_sum(T x, int line = __builtin_LINE()) {
  return detail::tree<T>(detail::post(EMU_SIMD_SUM, x, line), T(0),
                         [](T a, T b) { return T(a + b); });
}
template <class T>
inline T simd_product(T x, int line = __builtin_LINE()) {
  return detail::tree<T>(detail::post(EMU_SIMD_PRODUCT, x, line), T(1),
                         [](T a, T b) { return T(a * b); });
}
template <class T>
inline T simd_max(T x, int line = __builtin_LINE()) {
  return detail::tree<T>(detail::post(EMU_SIMD_MAX, x, line), detail::simd_type<T>::lowest(),
                         [](T a, T b) { return b > a ? b : a; });
}
template <class T>
inline T simd_min(T x, int line = __builtin_LINE()) {
  return detail::tree<T>(detail::post(EMU_SIMD_MIN, x, line), detail::simd_type<T>::highest(),
                         [](T a, T b) { return b < a ? b : a; });
}
template <class T>
inline T simd_shuffle(T x, ushort lane, int line = __builtin_LINE()) {
  return detail::slot<T>(detail::post(EMU_SIMD_SHUFFLE, x, line), lane);
}
template <class T>
inline T simd_broadcast(T x, ushort lane, int line = __builtin_LINE()) {
  return detail::slot<T>(detail::post(EMU_SIMD_BROADCAST, x, line), lane);
}
template <class T>
inline T simd_shuffle_xor(T x, ushort mask, int line = __builtin_LINE()) {
  const EmuSimdView* v = detail::post(EMU_SIMD_SHUFFLE_XOR, x, line);
  return detail::slot<T>(v, v->lane ^ mask);
}
template <class T>
inline T simd_shuffle_down(T x, ushort delta, int line = __builtin_LINE()) {
  const EmuSimdView* v = detail::post(EMU_SIMD_SHUFFLE_DOWN, x, line);
  return v->lane + delta < 32 ? detail::slot<T>(v, v->lane + delta) : x;
}
template <class T>
inline T simd_shuffle_up(T x, ushort delta, int line = __builtin_LINE()) {
  const EmuSimdView* v = detail::post(EMU_SIMD_SHUFFLE_UP, x, line);
  return v->lane >= delta ? detail::slot<T>(v, v->lane - delta) : x;
}
inline bool simd_any(bool x, int line = __builtin_LINE()) {
  const EmuSimdView* v = detail::post(EMU_SIMD_ANY, x, line);
  bool r = false;
  for (uint i = 0; i < 32; ++i) r = r || (((v->active >> i) & 1u) && detail::slot<bool>(v, i));
  return r;
}
inline bool simd_all(bool x, int line = __builtin_LINE()) {
  const EmuSimdView* v = detail::post(EMU_SIMD_ALL, x, line);
  bool r = true;
  for (uint i = 0; i < 32; ++i) r = r && (!((v->active >> i) & 1u) || detail::slot<bool>(v, i));
  return r;
}

}  // namespace metal

using namespace metal;  // as MLX's bf16.h does

inline uint3 emu_uint3(const uint32_t* p) { return uint3{p[0], p[1], p[2]}; }
