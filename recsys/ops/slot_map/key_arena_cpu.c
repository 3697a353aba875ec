/* The CPU loops of a key arena's lookup (recsys/ops/slot_map/key_arena_cpu.py): one pass over the ids
 * of a batch instead of a dozen tensor ops, each reading or writing every id.
 *
 * Plain C, no torch headers: the Python side passes the tensors' data pointers (contiguous,
 * int64 unless said otherwise) and keeps them alive for the call. Every loop runs over the ids
 * in order, so the results are those of the torch ops they replace, bit for bit (where torch
 * writes one place from several ids, its CPU kernels keep the last write, as these loops do).
 */
#include <stdint.h>

/* 0x9E3779B97F4A7C15 (Fibonacci hashing), as the torch path's int64 constant. */
#define FIBONACCI 0x9E3779B97F4A7C15ULL
/* ids per block of the find: their random reads are issued together, three blocks in flight
 * (32 ids, and 48 ahead below: the fastest lookup in the DLRM step at batch 256 and 2048,
 * against 16 / 64 / 128 ids and 16 / 96 ahead) */
#define BLOCK 32
/* how far ahead the update loops prefetch the slots they write */
#define AHEAD 48

/* splitmix64's finalizer on the 64 bits of k (recsys.ops.slot_map.hash_map.mix64). */
static inline uint64_t mix64(uint64_t z)
{
    z ^= z >> 30;
    z *= 0xBF58476D1CE4E5B9ULL;
    z ^= z >> 27;
    z *= 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* Each id's slot in its table of the arena, and the ids without one.
 *
 * For id i of the batch: entry h = ((ids[i] * FIBONACCI) >> 32 & hint_mask[i]) + hint_base[i]
 * of `hints` names a slot s; the hint is valid when keys[s] == ids[i] != empty_key, and then
 * slot_out[i] = s. Otherwise id i scans its bucket, first_bucket[i] + (mix64(ids[i]) >>> 1) mod
 * num_buckets[i] (recsys.ops.slot_map.hash_map.bucket_of), of bucket_size slots: where it finds its
 * key, slot_out[i] is that slot and hints[h] takes it; where not (a new key, empty_key),
 * slot_out[i] = -1 and its position goes to missing_out, its entry h to hint_at_out (ascending
 * position). Ids with mine[i] == 0 (mine NULL: every id is the arena's) keep their hinted slot
 * (their entries name the scratch) and are never listed. Returns how many were listed. */
int64_t recsys_arena_find(
    int64_t n,
    const int64_t *ids,
    const int64_t *hint_mask,
    const int64_t *hint_base,
    const int64_t *num_buckets,
    const int64_t *first_bucket,
    const uint8_t *mine,
    int64_t *hints,
    const int64_t *keys,
    int64_t bucket_size,
    int64_t empty_key,
    int64_t *slot_out,
    int64_t *missing_out,
    int64_t *hint_at_out)
{
    int64_t listed = 0;
    /* three blocks in flight: block b's hint entries are prefetched while block b - 1 reads
     * its hints (prefetching their slots' keys) and block b - 2 checks them */
    int64_t entry[3][BLOCK], hinted[3][BLOCK];
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
    for (int64_t b = 0; b < blocks + 2; ++b) {
        if (b < blocks) {
            int64_t *e = entry[b % 3];
            const int64_t start = b * BLOCK, m = n - start < BLOCK ? n - start : BLOCK;
            for (int64_t k = 0; k < m; ++k) {
                const int64_t i = start + k;
                /* the product wraps as torch's int64 multiply; >> is arithmetic (gcc, clang) */
                const int64_t mixed = (int64_t)((uint64_t)ids[i] * FIBONACCI) >> 32;
                e[k] = (mixed & hint_mask[i]) + hint_base[i];
                __builtin_prefetch(hints + e[k]);
            }
        }
        if (b >= 1 && b - 1 < blocks) {
            const int64_t *e = entry[(b - 1) % 3];
            int64_t *h = hinted[(b - 1) % 3];
            const int64_t start = (b - 1) * BLOCK, m = n - start < BLOCK ? n - start : BLOCK;
            for (int64_t k = 0; k < m; ++k) {
                h[k] = hints[e[k]];
                __builtin_prefetch(keys + h[k]);
            }
        }
        if (b < 2)
            continue;
        const int64_t *e = entry[(b - 2) % 3], *h = hinted[(b - 2) % 3];
        const int64_t start = (b - 2) * BLOCK, m = n - start < BLOCK ? n - start : BLOCK;
        for (int64_t k = 0; k < m; ++k) {
            const int64_t i = start + k, id = ids[i];
            if ((mine != 0 && !mine[i]) || (keys[h[k]] == id && id != empty_key)) {
                slot_out[i] = h[k];
                continue;
            }
            int64_t slot = -1;
            if (id != empty_key) {
                const uint64_t spread = mix64((uint64_t)id) >> 1;
                const int64_t bucket =
                    first_bucket[i] + (int64_t)(spread % (uint64_t)num_buckets[i]);
                const int64_t *row = keys + bucket * bucket_size;
                for (int64_t j = 0; j < bucket_size; ++j) {
                    if (row[j] == id) {
                        slot = bucket * bucket_size + j;
                        break;
                    }
                }
            }
            slot_out[i] = slot;
            if (slot >= 0) {
                hints[e[k]] = slot;
            } else {
                missing_out[listed] = i;
                hint_at_out[listed] = e[k];
                ++listed;
            }
        }
    }
    return listed;
}

/* A lookup's update of the slots its ids use: target[i] is id i's slot (the scratch slot for
 * ids that change nothing).
 *
 * count != 0: each table's distinct slots among the live ids (live may be NULL: all are) are
 * added to hits[table[i]]: with lfu_mode 0 or 1 in the same pass as the update, a slot counted
 * at its first id (whose last step is not yet `step`: steps only grow, so no slot's last step
 * is `step` before its step's lookup); with 2, the slots are first marked with INT64_MIN, a
 * value no last step takes. Then every target's last step becomes `step`, and its score:
 * lfu_mode 0 (every table LRU) `step`; 1 (every table LFU) one more per id; 2 (mixed:
 * lfu[table[i]] says) one more per id of an LFU table at its slot and at the scratch for the
 * others, then `step` at the slots of the others and at the scratch for the LFU ones (the torch
 * path's order). */
void recsys_arena_touch(
    int64_t n,
    const int64_t *target,
    const uint8_t *live,
    const int64_t *table,
    int64_t count,
    int64_t *hits,
    int64_t *last_seen,
    int64_t *scores,
    int64_t lfu_mode,
    const uint8_t *lfu,
    int64_t scratch,
    int64_t step)
{
    if (count && lfu_mode != 2) {
        /* one pass: a slot counts at its first live id (its last step is not yet `step`) */
        for (int64_t i = 0; i < n; ++i) {
            if (i + AHEAD < n) {
                __builtin_prefetch(last_seen + target[i + AHEAD], 1);
                __builtin_prefetch(scores + target[i + AHEAD], 1);
            }
            const int64_t slot = target[i];
            if ((live == 0 || live[i]) && last_seen[slot] != step)
                hits[table[i]] += 1;
            last_seen[slot] = step;
            if (lfu_mode == 0)
                scores[slot] = step;
            else
                scores[slot] += 1;
        }
        return;
    }
    if (count) {
        for (int64_t i = 0; i < n; ++i) {
            if (i + AHEAD < n)
                __builtin_prefetch(last_seen + target[i + AHEAD], 1);
            const int64_t slot = target[i];
            if ((live == 0 || live[i]) && last_seen[slot] != INT64_MIN) {
                last_seen[slot] = INT64_MIN;
                hits[table[i]] += 1;
            }
        }
    }
    for (int64_t i = 0; i < n; ++i) {
        if (i + AHEAD < n) {
            __builtin_prefetch(last_seen + target[i + AHEAD], 1);
            __builtin_prefetch(scores + target[i + AHEAD], 1);
        }
        const int64_t slot = target[i];
        last_seen[slot] = step;
        if (lfu_mode == 0)
            scores[slot] = step;
        else if (lfu_mode == 1)
            scores[slot] += 1;
    }
    if (lfu_mode == 2) {
        for (int64_t i = 0; i < n; ++i)
            scores[lfu[table[i]] ? target[i] : scratch] += 1;
        for (int64_t i = 0; i < n; ++i)
            scores[lfu[table[i]] ? scratch : target[i]] = step;
    }
}

/* One lookup of a training step: recsys_arena_find, then, where it listed no id (every id of
 * the arena has a slot), recsys_arena_touch of those slots (count on, live = mine: the ids of
 * no table hold the scratch slot) and each id's row in its table, rows_out[i] = slot_out[i] -
 * base[i] (rows_out may be slot_out). Where it listed ids, nothing is touched and rows_out is
 * not written (the caller places the new keys, then touches). Returns how many were listed. */
int64_t recsys_arena_lookup(
    int64_t n,
    const int64_t *ids,
    const int64_t *hint_mask,
    const int64_t *hint_base,
    const int64_t *num_buckets,
    const int64_t *first_bucket,
    const uint8_t *mine,
    int64_t *hints,
    const int64_t *keys,
    int64_t bucket_size,
    int64_t empty_key,
    int64_t *slot_out,
    int64_t *missing_out,
    int64_t *hint_at_out,
    const int64_t *table,
    const int64_t *base,
    int64_t *hits,
    int64_t *last_seen,
    int64_t *scores,
    int64_t lfu_mode,
    const uint8_t *lfu,
    int64_t scratch,
    int64_t step,
    int64_t *rows_out)
{
    const int64_t listed = recsys_arena_find(n, ids, hint_mask, hint_base, num_buckets,
        first_bucket, mine, hints, keys, bucket_size, empty_key, slot_out, missing_out,
        hint_at_out);
    if (listed)
        return listed;
    recsys_arena_touch(
        n, slot_out, mine, table, 1, hits, last_seen, scores, lfu_mode, lfu, scratch, step);
    for (int64_t i = 0; i < n; ++i)
        rows_out[i] = slot_out[i] - base[i];
    return 0;
}
