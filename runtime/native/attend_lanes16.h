/* The 16-lane settings of attend_isa.h (vec16.h's v16), shared by both AVX-512 builds of
 * paged_attention.c: included before each include of attend_isa.h, which undefines them again
 * (so no include guard). */
#define VW 16
#define VF v16
#define VLD ld16
#define VST st16
#define VLDBF ldbf16
#define VSUM8 sum8x16
#define VMAX(x, m) ((v16)_mm512_max_ps((__m512)(x), (__m512)(m)))
#define PV_NV 6
#define BF16_STAGE_V 0
