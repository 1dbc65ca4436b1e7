// attention_masks.cpp — the host side of scripts/check_attention_masks.sh: a warp of 32 threads
// runs the attention kernels' dropout-mask functions (kernels.inc, cut from the kernel sources
// by the script) with shuffles through shared slots, and every lane's result is compared with
// kept(), the per-element draw the dropout op makes. Exits 1 on any mismatch.
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <thread>
#include <vector>

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
#define __device__
#define __forceinline__ inline
#define static_assert(...)
static inline u32 __umulhi(u32 a, u32 b) { return (u32)(((u64)a * b) >> 32); }

// One warp: lane ids per thread, shuffles through slots between two barriers.
static thread_local int LANE;
static std::barrier<>* WARP;
static u32 SLOTS[32];
static u32 __shfl_xor_sync(u32, u32 v, int x) {
    SLOTS[LANE] = v;
    WARP->arrive_and_wait();
    u32 r = SLOTS[LANE ^ x];
    WARP->arrive_and_wait();
    return r;
}
// Bit l of the result: lane l's predicate.
static u32 __ballot_sync(u32, int pred) {
    SLOTS[LANE] = pred != 0;
    WARP->arrive_and_wait();
    u32 r = 0;
    for (int l = 0; l < 32; ++l) r |= SLOTS[l] << l;
    WARP->arrive_and_wait();
    return r;
}

#include "kernels.inc"

// Mismatches over every tile of a (3 heads, T, T) problem: the rows layout (forward, dQ)
// through kept_in_rows2 (two key tiles at a time), the columns layout (dK/dV) through
// kept_cols2 and mask_at.
static int check(int t) {
    Problem p{};
    p.b = 1;
    p.h = 3;
    p.t = t;
    p.threshold = (u32)(0.7 * 65536.0);
    p.key = 0x1234567890abcdefULL;
    p.inv_keep = 1.f / 0.7f;
    std::barrier warp(32);
    WARP = &warp;
    std::vector<int> bad(32, 0);
    std::vector<std::thread> lanes;
    for (int lane = 0; lane < 32; ++lane) {
        lanes.emplace_back([&, lane] {
            LANE = lane;
            const int g = lane >> 2, t4 = lane & 3;
            for (int bh = 0; bh < 3; ++bh)
                for (int r = 0; r + 16 <= t; r += 16)
                    for (int c = 0; c + 16 <= t; c += 16) {
                        bool k[2][2][2];
                        kept_in_rows2(p, bh, r + g, c, t4, k);
                        for (int u = 0; u < 2; ++u)
                            for (int i = 0; i < 2; ++i)
                                for (int e = 0; e < 2; ++e)
                                    bad[lane] += k[u][i][e] !=
                                                 kept(p, bh, r + g + 8 * i, c + 8 * u + 2 * t4 + e);
                    }
            if (t % 8 != 0) return;  // the dK/dV kernel then draws per element
            for (int bh = 0; bh < 3; ++bh)
                for (int kb = 0; kb + 16 <= t; kb += 16)
                    for (int q = 0; q + 16 <= t; q += 16) {
                        const u32 mb[1] = {kept_cols2(p, bh, q, kb, g, t4)};
                        for (int u = 0; u < 2; ++u)
                            for (int e = 0; e < 4; ++e) {
                                bool want = kept(p, bh, q + 8 * u + 2 * t4 + (e & 1), kb + g + 8 * (e >> 1));
                                bad[lane] += (mask_at(mb, u, e, p) != 0.f) != want;
                            }
                    }
        });
    }
    for (auto& l : lanes) l.join();
    int sum = 0;
    for (int b : bad) sum += b;
    return sum;
}

int main() {
    int total = 0;
    for (int t : {64, 72, 128, 200, 36, 68, 70, 33}) {
        int bad = check(t);
        std::printf("T %3d: %d mismatches\n", t, bad);
        total += bad;
    }
    std::printf(total ? "FAILED\n" : "every lane draws the per-element mask\n");
    return total ? 1 : 0;
}
