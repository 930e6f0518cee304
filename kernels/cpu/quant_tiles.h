// Linear layers from quantized blocks with inputs rounded to int8 (quant_tiles.cpp), called by quant.cpp's qlinear.
#pragma once
#include <cstdint>

namespace pagedserve {

// Whether this build has the int8 path (AVX-512 VNNI).
bool qlinear_int8_built();

// out[m, n] (row stride ldo) = sum_k x[m, k] * w[n, k] for M input rows (fp32, or bf16 when x_bf16) and N
// weight rows of row_bytes of blocks of type t (interleaved across 16 rows when interleaved: quant_x16.h);
// out is fp32, or bf16 when out_bf16. Any M.
void qlinear_int8(int t, const void* x, bool x_bf16, const uint8_t* w, int M, int N, int K, int64_t row_bytes,
                  void* out, int64_t ldo, bool out_bf16, bool interleaved);

}  // namespace pagedserve
