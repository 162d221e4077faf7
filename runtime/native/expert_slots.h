/* The routed slots of a layer sorted by expert, for the fused expert kernels' layer-wide calls
 * (expert_amx.c, expert_fp32.c): the T*k slots (top_i/top_w [T, k], int64 / fp32) into tok/tw
 * ([T*k], each slot's token and routing weight), grouped by expert by a counting sort that keeps
 * the slots of one expert in slot order, as a stable argsort orders them (kernels._run_experts).
 * Header-only. */
#ifndef MOECC_EXPERT_SLOTS_H
#define MOECC_EXPERT_SLOTS_H

#include <stdint.h>
#include <string.h>

#define MAX_EXPERTS 4096  /* experts of a layer the layer-wide calls take (their counts on the stack) */

/* Where expert e's sorted slots start (sort_slots' at[e - 1], or 0); at[e] is where they end. */
static inline int64_t slot_start(const int64_t *at, int64_t e) { return e ? at[e - 1] : 0; }

/* at[e] = the end of expert e's sorted slots (at[e - 1], or 0, its start) for e < E; pos[s] (pos not
 * NULL) = where slot s went among them. Returns 0, or 1 with nothing sorted where a slot names an
 * expert outside [0, E) or one whose weights are missing (gu[e] or dn[e] zero). */
static int sort_slots(int64_t T, int64_t k, const int64_t *top_i, const float *top_w, int64_t E, const int64_t *gu,
                      const int64_t *dn, int64_t *at, int64_t *tok, float *tw, int64_t *pos) {
    int64_t start[E + 1];  /* start[e]: expert e's first sorted slot (then its next free one) */
    memset(start, 0, sizeof(start));
    for (int64_t s = 0; s < T * k; s++) {
        const int64_t e = top_i[s];
        if (e < 0 || e >= E || !gu[e] || !dn[e]) return 1;
        start[e + 1]++;
    }
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    for (int64_t s = 0; s < T * k; s++) {
        const int64_t p = start[top_i[s]]++;
        tok[p] = s / k, tw[p] = top_w[s];
        if (pos) pos[s] = p;
    }
    memcpy(at, start, (size_t)E * sizeof(int64_t));  /* start[e] is now expert e's end */
    return 0;
}

#endif
