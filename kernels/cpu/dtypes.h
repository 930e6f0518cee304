// fp32 and bfloat16 (stored as uint16_t) element access shared by the CPU kernels: every value is computed in
// fp32; bf16 is read by a shift and written rounded to nearest even, as torch does.
#pragma once
#include <cstdint>
#include <cstring>

namespace pagedserve {

inline float load(const float* p) { return *p; }
inline float load(const uint16_t* p) {
  const uint32_t u = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void store(float* p, float f) { *p = f; }
inline void store(uint16_t* p, float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  *p = static_cast<uint16_t>(u >> 16);
}

}  // namespace pagedserve
