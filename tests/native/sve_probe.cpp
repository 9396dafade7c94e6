// The SVE vector length of the calling thread, read with SVE's own instruction (RDVL via
// svcntb()) in a vector-length agnostic build (+sve, no -msve-vector-bits, where the
// compiler would fold it to a constant). Used by kernel_bits.cpp to show, independently of
// dispatch.cpp's prctl(), at which length an emulated run really executes.
#include <arm_sve.h>

int sve_probe_bytes() { return static_cast<int>(svcntb()); }
