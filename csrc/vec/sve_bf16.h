// SVE with the BF16 conversion instruction (BFCVT, FEAT_BF16 with SVE) for the bf16 store;
// everything else is VecSve, at the same fixed vector length. Compiled only in the
// sve<bits>_bf16 builds (+sve+bf16 -msve-vector-bits=<bits>).
// NOTE: BFCVT rounds to nearest even, and with FPCR.FZ = 0 (pool.cpp sets the default FPCR
// around every kernel call) it rounds denormals exactly, as the integer path does. It keeps
// a NaN's sign and payload (quietened) instead of giving 0x7FC0, so NaN lanes are patched
// with the canonical NaN: bit-identical to VecScalar::store_bf16.
#pragma once
#include "sve.h"

namespace cpu_offload {
namespace {

struct VecSveBf16 : VecSve {
  // BFCVT writes each result to the low half of its 32-bit lane (the upper half is left
  // undefined by the _x form; ST1H never stores it).
  static SveU32 round_bf16(F x) {
    const svbool_t pg = all();
    const svuint32_t r = svreinterpret_u32_bf16(svcvt_bf16_f32_x(pg, x));
    return svsel_u32(svcmpuo_f32(pg, x, x), svdup_n_u32(0x7FC0), r);
  }
  static void store_bf16(uint16_t* p, F x) { svst1h_u32(all(), p, round_bf16(x)); }
  static void stream_bf16(uint16_t* p, F x) { store_bf16(p, x); }  // see VecSve::stream_bf16
};

}  // namespace
}  // namespace cpu_offload
