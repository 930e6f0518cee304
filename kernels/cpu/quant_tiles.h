// The int8 VNNI tile path of the quantized linear layers (quant_tiles.cpp), called by quant.cpp's qlinear.
#pragma once
#include <cstdint>

namespace pagedserve {

// The fewest input rows the tile path is used for with ggml type t; 0 where the build has no tile path.
int qtile_min_rows(int t);

// out[m, n] (row stride ldo) = sum_k x[m, k] * w[n, k] for M input rows (fp32, or bf16 when x_bf16) and N
// weight rows of row_bytes of blocks of type t; out is fp32, or bf16 when out_bf16.
void qgemm_tiles(int t, const void* x, bool x_bf16, const uint8_t* w, int M, int N, int K, int64_t row_bytes,
                 void* out, int64_t ldo, bool out_bf16);

}  // namespace pagedserve
