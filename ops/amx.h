/* amx.h — private to the AMX kernels (linear_amx.c, attention_amx.c), built
 * with the AMX flags: the tile configuration a thread loads before its tile
 * instructions (palette 1: eight tiles of up to 16 rows of 64 bytes). */
#ifndef KW_AMX_H
#define KW_AMX_H

#include <immintrin.h>
#include <stdint.h>

typedef struct kw__amx_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} kw__amx_config;

static inline void kw__amx_set_tile(kw__amx_config *t, int tile, int rows, int colsb) {
    t->rows[tile] = (uint8_t)rows;
    t->colsb[tile] = (uint16_t)colsb;
}

/* All eight tiles full: 16 rows of 64 bytes. */
static inline void kw__amx_load_full_tiles(void) {
    kw__amx_config cfg = {.palette = 1};
    for (int t = 0; t < 8; t++) kw__amx_set_tile(&cfg, t, 16, 64);
    _tile_loadconfig(&cfg);
}

#endif
