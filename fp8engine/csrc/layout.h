// The nt16 layout's permutation (fp8engine/weights/layout.py) of whole groups of 16 rows, in place: the op in
// layout.cpp, and bf16_linear.cpp, which gives torch's GEMM a rows copy of an nt16 weight at prefill-sized M.
//   E4M3 (1-byte elements, K % 4 == 0): byte 16 L + 8 h + 2 i + b of line c is row 4 L + i, column 4 c + 2 h + b,
//   so the bytes move in pairs b: 16-bit element 8 L + 4 h + i of line c <- row 4 L + i, pair 2 c + h.
//   bf16 (2-byte elements, K even): 32-bit element r of line q <- row r, pair q.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace fp8e_layout {

constexpr int64_t kGroup = 16;

// One group of E4M3 codes (16 rows of `pairs` 16-bit pairs): rows -> lines, or back.
inline void permute_e4m3_group(uint16_t* g, uint16_t* buf, int64_t pairs, bool to_nt16) {
  const int64_t n = kGroup * pairs;
  std::memcpy(buf, g, sizeof(uint16_t) * n);
  for (int64_t c = 0; c < pairs / 2; ++c)
    for (int64_t l = 0; l < 4; ++l)
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t i = 0; i < 4; ++i) {
          const int64_t line = c * 32 + 8 * l + 4 * h + i, row = (4 * l + i) * pairs + 2 * c + h;
          if (to_nt16)
            g[line] = buf[row];
          else
            g[row] = buf[line];
        }
}

// One group of bf16 values (16 rows of `pairs` 32-bit pairs) from `from` to `to` (distinct): rows -> lines, or back.
inline void move_bf16_group(const uint32_t* from, uint32_t* to, int64_t pairs, bool to_nt16) {
  for (int64_t q = 0; q < pairs; ++q)
    for (int64_t r = 0; r < kGroup; ++r) {
      if (to_nt16)
        to[q * kGroup + r] = from[r * pairs + q];
      else
        to[r * pairs + q] = from[q * kGroup + r];
    }
}

// The same in place, through `buf`.
inline void permute_bf16_group(uint32_t* g, uint32_t* buf, int64_t pairs, bool to_nt16) {
  std::memcpy(buf, g, sizeof(uint32_t) * kGroup * pairs);
  move_bf16_group(buf, g, pairs, to_nt16);
}

// Groups [0, groups) of a [N, K] matrix at `base` (element size esize: 1 for E4M3, 2 for bf16), each thread
// moving a group through a buffer of its size.
inline void permute_groups(uint8_t* base, int64_t groups, int64_t k, int64_t esize, bool to_nt16) {
  const int64_t group_bytes = kGroup * k * esize;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> buf((group_bytes + 3) / 4);
    for (int64_t g = begin; g < end; ++g) {
      uint8_t* p = base + g * group_bytes;
      if (esize == 1)
        permute_e4m3_group(reinterpret_cast<uint16_t*>(p), reinterpret_cast<uint16_t*>(buf.data()), k / 2, to_nt16);
      else
        permute_bf16_group(reinterpret_cast<uint32_t*>(p), buf.data(), k / 2, to_nt16);
    }
  });
}

// Groups [0, groups) of a bf16 [N, K] matrix in the layout at `src`, as rows at `dst` (another matrix): one pass,
// no buffer.
inline void bf16_groups_to_rows(const uint16_t* src, uint16_t* dst, int64_t groups, int64_t k) {
  const int64_t group = kGroup * k;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      move_bf16_group(reinterpret_cast<const uint32_t*>(src + g * group), reinterpret_cast<uint32_t*>(dst + g * group),
                      k / 2, false);
  });
}

}  // namespace fp8e_layout
