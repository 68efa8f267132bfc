// The routed experts of a MoE layer on the GPU: tokens grouped by expert, two grouped GEMMs on the
// tensor cores (mma.sync m16n8k16 on BF16, fp32 accumulation), nothing copied back to the host.
//
// prepare_experts packs each layer's per-expert host tensors into two device arrays in BF16:
// gate_up [E, 2F, D] (expert e: its F gate rows, then its F up rows) and down [E, D, F]. F16 and
// F32 checkpoints are converted on the host while they pass through a pinned staging buffer.
//
// Two precisions for the activations, picked per call by ops_cuda_matmul_precision() (the weights
// are BF16 and exact either way):
//   medium  x and the hidden h are rounded to BF16 (relative error <= 2^-8 each) and each weight
//           fragment meets one activation fragment: one mma.sync per k16 step.
//   high    each activation a is carried as two BF16 numbers, hi = bf16(a) and lo = bf16(a - hi),
//           so hi + lo holds a to 16 significant bits (error <= 2^-16 |a|), and each weight
//           fragment, loaded once, meets both, two mma.sync per k16 step: acc = hi w + acc on the
//           tensor cores, then acc += lo w, the lo product taken from a zero accumulator and added
//           in fp32 (round to nearest). The tensor cores' accumulation truncates toward zero, up
//           to an ulp of acc per step; feeding lo through it as well would double that biased
//           error, this way it stays as in medium and the lo products cost an unbiased rounding.
//           Decode reads the same weight bytes (H200, Qwen3-30B-A3B's experts: 1.0 to 1.17 times
//           medium's time for T = 1 to 256); prefill does twice the tensor work (1.8 times at
//           T = 4096). BF16 weights of a shape the wgmma kernel takes sum the lo products
//           through the tensor cores' accumulator too: per k16 step acc = hi w + acc, then
//           acc = lo w + acc, one chain (moe_tile_cfg's ONE). That is the wgmma kernel's way at
//           prefill sizes (bf16_gemm.cu: a wgmma pipeline cannot add a fresh product in fp32
//           without waiting on every step), and every BF16 tile below them sums the same way,
//           so a token's rows are the same bits at any batch (MOESERVE_ONE_CHAIN=0: the fp32
//           add outside deterministic mode). The truncations then come twice a step, so their
//           biased part doubles (at most 2^-23 |acc| a step each, about 2^-16 |acc| over
//           2048 k against 2^-17), still far below medium's 2^-8 of the inputs; the sums need
//           no second set of accumulators, which lets the wgmma kernels take medium's tiles.
//           The cost at decode sizes: a step's two products on one accumulator follow one
//           another (H200, Qwen3-30B-A3B's experts at T = 1 in a chain of calls 25.1 us against
//           24.5; a batch-1 step 3.098 ms against 3.045); at 64 pairs an expert 441.9 us against
//           466.4.
//           (Until 2026-12-03 the hi and lo products ran in two chains added at the end:
//           twice the accumulators, half the columns a tile, x's rows read twice as often.)
//           FP8 and NVFP4 weights sum the same way in high precision at every size since
//           2026-12-04 (q_one_chain; MOESERVE_ONE_CHAIN=0 as for BF16): FP8 each 128-k block's
//           hi and lo products in one chain from zero, then tot += scale x acc; NVFP4 as BF16,
//           its tensor scale on the sums. Those are the W8A16 and W4A16 wgmma kernels' sums at
//           prefill sizes, so a token's quantized rows are the same bits at any batch too
//           (tests/test_cuda_moe checks it bit for bit up to the wgmma sizes). H200,
//           Qwen3-30B-A3B's experts, high, against the fp32 add: FP8 T = 1 in a chain 22.7 us
//           against 23.6, T = 8 110.8 against 104.7, T = 1024 625 against 697, batch-1 steps
//           3.15-3.16 ms against 3.20-3.21, batch 64 20.07 against 19.80; NVFP4 T = 1 23.1
//           against 23.6, T = 256 296.6 against 320.5, steps at batch 1 3.174 ms against 3.215,
//           batch 64 18.81 against 19.13.

// moe_experts(out[T, K, D], x[T, D], topk_ids[T, K]) is three launches on the backend's stream
// (four from T = 512 at D = 2048, where x's conversion is a kernel of its own after the count):
//   1. prepare (one block; the other blocks of the same launch convert x to BF16 xb[T, D], in
//      high also its remainders xb_lo[T, D]):
//      count the (t, k) pairs per expert, prefix sums into offsets[E + 1], scatter the pair ids
//      grouped by expert into pairs[n] (a counting sort with per-warp segments: within an expert
//      by segment, and within a segment in the order the count's shared atomics gave out ranks,
//      so nothing depends on the timing between warps; a row's sums do not depend on its place),
//      and cut each expert's rows into tiles of BM rows: tiles[i] = {expert, first row, end row},
//      n_tiles. All of it stays on the device.
//   2. GEMM 1: h[n, F] = silu(xb_e gate_e^T) * (xb_e up_e^T) in BF16 (high: h and h_lo). A block
//      is one (tile, N-block); it reads its expert and rows from the tile table and exits when its
//      tile is past n_tiles. The grid is the host's upper bound on the tile count (from T*K, E and
//      BM) times the N-blocks. Each warp's B tile holds matching gate and up rows, so SiLU x up
//      happens in registers, in fp32. The A rows are gathered from xb through pairs (t = pair / K).
//   3. GEMM 2: y[n, D] = h down_e^T, each row written in fp32 straight to out[t, k, :].
// The GEMMs are launched with programmatic dependent launch: each starts on the SMs while the
// kernel before it drains, and GEMM 2 fetches its first weight tiles before h is ready.
// Skipped slots (negative ids) never enter the grouping, so their rows of out stay as they were.
//
// NVFP4 experts (W4A16, cuda_prepare_experts_nvfp4: E2M1 codes two a byte, an E4M3 scale per 16,
// a tensor scale per weight): every path and tile shape above with WQ, where a stage carries the
// codes and scales (9/32 of the BF16 bytes) and each lane decodes its own B fragments from them
// in registers (wq_frag: rotations and masks put a code's sign and magnitude into BF16 bits,
// gemm_common.cuh's wq_decode; one bf16x2 product applies the group scale, exactly), rearranged
// once at load so that a lane's codes are one word and each code's bits sit where the rotations
// take them (nvfp4_pack_kernel). The tensor scale multiplies the sums in the epilogue.
// The same k16 order, so a token's rows are the same bits at any batch here too.
// H200, Qwen3-30B-A3B experts, tests/test_cuda_moe --nvfp4 (medium / high; weight bytes of the
// experts touched over time against the 1 GiB copy rate):
//   T = 1    23.5 / 29.2 us (21% / 17%)   BF16: 26.8 / 29.5 us
//   T = 64  189.1 / 252.1 us (42% / 31%)  BF16: 290.8 / 292.4 us
//   T = 1024 414.6 / 716.3 us              BF16: 406 / 622 us
// The decode is the bound now, not the bytes: about 4.5 instructions a weight, and at T = 1 the
// 768 warps of GEMM 1 (16 rows each, the k16 order forbids splitting k) leave 6 warps an SM.
// Steps that got there, each measured (T = 1 / T = 64, medium):
//   - the stage decoded into a BF16 tile in shared memory through float tables, behind a second
//     barrier per k tile: 51.1 / 382 us (the first version)
//   - each lane decodes its own fragments from the codes (the layout above): 34.9 / 366 us
//   - the loads' addresses computed once, not per k tile (they were as many instructions as the
//     decode), and a lane's code words and scales loaded once per 64 k: 27.2 / 231 us
//   - the m16 tile known busy at compile time (one straight run of code per k tile), products
//     not volatile: 23.3 / 189 us
//   - more stages (up to 16, every k tile of a block in flight): no better, fewer blocks an SM.
//   - (2026-12-04; DeepSeek-V3's experts, 32 of them, T = 1, medium / high) each code's bits
//     placed for rotations, 11 instructions a word of codes instead of 15: 114.2 / 146.7 ->
//     110.0 / 139.7 us; in high the copies inside Kd without a guard each (LEAN): 131.6 us.
//   - tried, not kept: the weights streamed straight into registers, no stages (bit for bit the
//     same; 9% fewer instructions, slower at T = 1). docs/benchmarks.md has the figures.
//   - (2026-12-04, sixth session) the tiny path in k tiles of 256 (q_shape), 128 bytes of codes
//     a weight row a stage instead of 64. Not the instructions but the reads' width held it: a
//     block reading 64 bytes from each of 64 rows 3.5 KB apart a stage streams at 2.6 TB/s (63%
//     of the copy rate) with no arithmetic at all, 128 bytes a row at 3.9 TB/s (91%; build/
//     bench_stream_rows, docs/benchmarks.md). In a chain of calls, medium / high: Qwen3-30B-A3B's
//     experts at T = 1 19.4 / 22.8 -> 18.0 / 20.6 us, T = 2 29.4 / 34.3 -> 26.6 / 30.9;
//     DeepSeek-V3's (32 experts) at T = 1 106.9 / 125.6 -> 89.9 / 118.0 (44% -> 52% of the copy
//     rate in medium). The same sums (each output's k16 products in order).
//   - (seventh session) the decode shape in k tiles of 256 as well, and the middle shape (BM 64)
//     in k tiles of 128 (FP8 in high too), q_shape. DeepSeek-V3's experts (32), single calls,
//     medium / high, us: 2 pairs an expert 363.7 / 457.8 -> 356.6 / 390.9, 8 pairs 402.6 / 498.1
//     -> 406.2 / 421.1, 16 pairs 497.2 / 623.2 -> 429.5 / 590.0, 32 pairs 576.3 / 768.2 ->
//     504.2 / 751.6; Qwen3-30B-A3B's at T = 256 (16 pairs an expert) 242.7 / 292.5 -> 212.5 /
//     277.8. FP8 in high, 16 pairs an expert: 706.0 -> 630.6 (DeepSeek-V3), Qwen3 T = 256 325.1 ->
//     296.1. Tried: medium's wide middle shape (BM 128) in k tiles of 128, slower (T = 256 on
//     DeepSeek-V3's, 64 pairs an expert: 786.4 -> 1106.1); the middle shape in k tiles of 256
//     (medium: 587.6 at 16 pairs) or with three stages of codes in high (748.6).
//
// FP8 experts (W8A16, cuda_prepare_experts_fp8: E4M3 codes, a fp32 scale per 128 x 128 block as
// DeepSeek-V3 ships them): every path with WF_FP8, where a stage carries the codes (half the BF16
// bytes) and each lane decodes its own B fragments (fp8_w8_decode of kernels/quant.h: a shift and
// a mask or two put sign, exponent and mantissa into BF16 bits worth e4m3 2^-120, and one bf16x2
// product by 2^120 makes them exact), rearranged once at load (fp8_pack_kernel). A block scale
// does not fit beside three mantissa bits in BF16, so it is applied to sums: each 128 k of an
// output accumulate apart (the same k16 order), and at the end of the 128 the partial sum is
// added into the total times its row's scale (one fp32 fma; the weight row is the output column,
// so a lane's two columns of an n8 tile take two scales, one float2 load). The same boundaries at
// every tile shape and batch: a token's rows are the same bits at any batch here too. The scales
// are stored per weight row and 128-k block, [E, ceil(Kd / 128), rows], so gate and up rows keep
// their own whatever F is, and travel in the stages beside the codes (a float a row a k tile,
// cp.async like them), so they are in shared memory when a 128-k block ends. Loaded from global
// memory at that point instead, each k tile waited a round trip for them: H200, Qwen3-30B-A3B's
// experts, medium (tests/test_cuda_moe --fp8, one call, % of the copy rate), T = 64 195.0 us
// (74.2%) against 256.0 (56.9%), T = 16 131.2 us (72.1%), T = 1 23.9 us against 25.3.
// At decode sizes outside deterministic mode (by default up to 8 pairs an expert on average, NVFP4
// and FP8 in high precision up to 16) FP8 and NVFP4 experts run on the lean kernels instead
// (moe_lean.h: the weights as wgmma's A operand, the same sums; MOESERVE_FP8_LEAN,
// MOESERVE_NVFP4_LEAN).
// One exception (fp8_gemm.h, fp8_w8a8_takes): in medium precision outside deterministic mode, from
// 16 pairs an expert, GEMM 1 quantizes x per token per 128 channels and runs on the FP8 tensor
// cores (W8A8, kernels/cuda/fp8_gemm.cu), writing the same h, and GEMM 2 quantizes h the same way
// and runs there too (fp8_w8a8_down; MOESERVE_W8A8_DOWN=0 keeps the W8A16 tiles for it); those
// rows are other sums than the W8A16 tiles' (within medium's tolerance of a reference with h on the
// FP8 grid), so there a token's rows depend on the batch's size.
// H200, Qwen3-30B-A3B's experts, medium: 433.7 us at T = 1024 against 513.8 with W8A16; a model's
// prefill of 8 x 2048 tokens 13703 tokens/s against 12993 (`MOESERVE_W8A8=0`); from 16 pairs an
// expert rather than 48 (2026-12-02): T = 256 253.9 us against 274.3, T = 512 278.2 against 320.0;
// with GEMM 2 on the FP8 tensor cores too (later that day): T = 256 233.6 us, 1024 302.7 against
// 362.6, 4096 790.4 against 1010.7.
// In high precision at prefill sizes both GEMMs run on the wgmma kernel instead (unless
// MOESERVE_W8A16_WGMMA=0; bf16_gemm.h's bf16_wgmma_w8_takes): the codes decoded into BF16 tiles
// by converter warps, each 128-k block's hi and lo products in one fp32 sum, folded into the
// totals times the block's scale: since 2026-12-04 the tiles' own sums in high precision (their
// one chain, below), so a token's rows do not depend on the batch's size (with
// MOESERVE_ONE_CHAIN=0 the tiles add the lo products in fp32, other sums). Deterministic mode
// keeps the tiles at every size (bf16_gemm.cu's bwg_switch). H200, Qwen3-30B-A3B's experts, high:
// T = 2048 1100.8 us against the tiles' 1244.9, T = 4096 1642.1 against 2150.9; at T = 256 and
// 1024 (16 and 64 pairs an expert) it was 1.75 and 1.02 times the tiles' time, hence its minimum.
//
// BF16 experts at prefill sizes (more than 48 pairs an expert, bf16_gemm.h) run both GEMMs on
// wgmma instead (kernels/cuda/bf16_gemm.cu), after the same prepare kernel: in medium the same
// bits as the tiles here (a wgmma k16 step is an mma.sync k16 step bit for bit), in high the
// hi and lo products in one chain (with the tiles below its sizes in one chain too,
// moe_experts_path). H200, Qwen3-30B-A3B's experts at T = 4096 (balanced): 701 /
// 1162 us against 1163 / 2016 on the tiles here.
//
// The tiny path (T*K <= 16: T = 1 and 2 at K = 8) is two launches, the GEMMs alone: each block
// groups the at most 32 ids itself with warp votes (tiny_group: busy experts in order of their
// first pair, pairs in (t, k) order), h is indexed by pair id, and GEMM 1 converts its rows of x
// (one at T = 1) into shared memory for the whole of D while its first weight stages are in
// flight (NVFP4, and FP8 in medium: x's rows requested before the weights, so that they do not
// queue behind them, as they did before, 1.6 us of the stamped build's FP8 call below. H200,
// Qwen3-30B-A3B's experts in a chain of calls: FP8 in medium 20.1 -> 19.7 us at T = 1, 31.5 ->
// 29.9 at T = 2; NVFP4 19.9 -> 19.3 at T = 1 in medium, 31.0 -> 29.5 / 35.8 -> 34.4 at T = 2 in
// medium / high; batch-2 steps 1 to 3% faster). The same k16 order into one fp32 accumulator and
// the same conversion: the same bits as the grouped path (the test runs a token alone, tiny,
// against the same token in larger batches).
//
// Where the tiny path's time goes: a timeline of globaltimer stamps per block (a scratch build
// whose stamps cost about 4 us a call; FP8, medium, T = 1, in a chain, x's rows still requested
// after the weights; us from the first block of GEMM 1). GEMM 1: grouping done at 1.5, first k
// tile in shared memory at 4.8, k loop 10.5 (8.2 on a multiprocessor with one block, 10.8 with
// two), done at 16.4. GEMM 2: released at 17.0, k loop 5.7, done at 23.8. With the products and
// the decode skipped (wrong sums, as a bound) the k loops take 4.7 and 2.1: at decode sizes the
// quantized tiles' pace is not their bytes (about 5.4 instructions a weight in GEMM 1, 1.5 warps
// a scheduler, issue slots 30% busy: ncu), while BF16's loop is the bytes' (10.4 without
// products, 12.0 with). So the three formats take about the same time at T = 1 though they read
// 75, 39 and 21 MB. Nor is it the decode's instructions or the products' chains: FP8 codes
// converted by the hardware (FP8 activations, two instructions a word of codes instead of nine)
// or each 128-k block's products over two accumulators left T = 1 where it was (docs/
// benchmarks.md, 2026-12-04, fifth session). Both kept each k tile's wait, barrier and
// shared-memory reads. The barrier is part of it: with each warp copying its own weight rows
// (PRIV in the kernel), a k tile waits for the warp's copies and no other warp's, the same sums:
// H200, DeepSeek-V3's experts (test_cuda_moe --deepseek-fp8-timing 32 1, three runs alternating)
// 128.4 -> 118.6 us (66.9% -> 72.5% of the copy rate; in a chain 125.2 -> 117.4, 73.2%),
// Qwen3-30B-A3B's at T = 1 and 2 and their batch-1 and batch-2 steps as before. First in FP8's
// GEMM 1 in medium; since the sixth session in both GEMMs of every format and precision, GEMM 2
// with each warp copying the tile's rows of h (up to four; more take the block's copies and
// barrier) into its own rows of the stage. That second step (H200, in a chain, medium / high,
// us): BF16 at T = 1 23.5 / 24.4 against 23.3 / 25.0, at T = 2 38.6 / 38.6 against 38.8 /
// 39.6; FP8 in high 1.5 to 3% faster (DeepSeek-V3's at T = 1 128.0 -> 124.0), NVFP4 within
// 1.5% either way, medium as before. (NVFP4's pace was partly the width of its reads, not its
// instructions: k tiles of 256 since the sixth session, above.)
// FP8 in medium since then also takes four stages of codes instead of six where that fits a
// grid in one wave that six do not (tiny_fewer_stages): DeepSeek-V3's experts at T = 1 116.0 ->
// 101.4 us (74.5% -> 85.3% of the copy rate; in a chain 112.2 -> 98.0, 88.2%), Qwen3-30B-A3B's
// at T = 2 33.8 -> 30.3 (GEMM 2; a batch-2 step 3.60 -> 3.50 ms). Since the seventh session FP8
// in high and NVFP4 too, one or two stages of codes fewer (launch_tiny_fewer): FP8 in high on
// DeepSeek-V3's experts at T = 1 124.4 -> 113.3 us in a chain (69.5% -> 76.4%).
//
// Decode at T = 1 (H200, Qwen3-30B-A3B's experts: 8 experts, 75.5 MB of weights, medium / high;
// the 1 GiB device copy runs at 4.23 TB/s, a copy moving the same 75.5 MB takes 21.8 us, 82% of
// that rate, so fixed costs weigh at this size):
//   grouped path (three launches)                                29.0 / 33.8 us (62% / 53%)
//   tiny path (kept)                                             26.8 / 29.5 us (67% / 60%)
//     its GEMM 1 alone 19.6 us (50 MB), GEMM 2 alone 12.3 us (25 MB): each kernel carries 6-8 us
//     over its bytes at the copy rate, and the two overlap by 4.5 us through PDL. At T = 2 the
//     tiny path takes 43.0 / 46.4 us against 51.5 / 49.7 grouped; DeepSeek-V3 shape at T = 1
//     175.8 / 182.9 us (95% / 91%) against 176.1 / 215.4. With x's rows held for up to 32 KB
//     (more rows per tile at T = 2, two blocks per SM in high) T = 1 took 27.4 / 31.6 us.
// Tried and dropped (T = 1 medium unless said):
//   - GEMM 1 in 384 blocks of BN 32 (two warps, six stages), for 132 SMs: 28.4 us; four stages or
//     BN 64 with six: no better. GEMM 2 with three stages, BN 32 or BK 64: 28.6-28.8 us.
//   - L2 bulk prefetch (cp.async.bulk.prefetch) of GEMM 2's weights by GEMM 1's blocks, all or
//     half of each down row, at their last load or four k tiles earlier: 29.4-31.7 us; GEMM 2's
//     blocks prefetching the rest of their rows into L2 before waiting for h: 30.1 us. The prefetch
//     only moves bytes earlier on a bus that is already busy.
//   - Both GEMMs in one kernel (work items from a counter, GEMM 2 items waiting on per-tile counts
//     of finished GEMM 1 items): 29.7 / 33.4 us; each item's atomic fetch and topk_ids read sit
//     before its first weight load. (DeepSeek-V3 shape: 176 / 215 -> 174 / 182 us; the tiny
//     path's GEMM 1 has the same four stages in high.)
//   - x converted per k tile from fp32 with single loads (a round trip per 16-byte chunk before
//     the first product): DeepSeek-V3 shape at T = 1 202.8 us against 176.1 grouped; batching the
//     loads fixed it.
//   - Wider column blocks in the tiny path (BN 128 for GEMM 1, GEMM 2 or both: 96 or 128 blocks,
//     one wave): T = 1 28.3 / 28.4 / 28.9 us medium against 27.0 with BN 64 in the same run
//     (high 32.7 / 29.9 / 32.1 against 29.5); T = 2 up to 54 us against 44.
//   - The tiny path at T = 4 (32 pairs, 2 waves of blocks): 83.0 / 87.0 us against the grouped
//     path's 81.0 / 82.3, hence the limit of 16 pairs. Earlier (see git history): L2 prefetch
//     hints before the PDL wait and evict-first weights, 29.8-30.1 us against 29.0.
//   - The router's top-k in the tiny GEMMs (each block routing its token from the logits, the
//     same bits; no top-k kernel): router + experts 35.1 / 33.2 us against 32.8 / 30.2 with the
//     top-k kernel before (high / medium), a batch-1 step 3.40 ms against 3.25.
//   - Kd cut into S k ranges whose blocks form a thread-block cluster and add their sums in range
//     order through each other's shared memory before the epilogue (2026-12-04; other sums than
//     the one chain, so never in deterministic mode). FP8 at T = 1, single call, medium / high:
//     S = 1 25.0 / 27.9 us; GEMM 1 in 2 ranges 25.1 / 28.3, in 4 29.8 / 33.6; both GEMMs in 2
//     28.3 / 32.6; NVFP4 and BF16 slower the same way; batch-1 steps 3.23 -> 3.69 ms (FP8, 4 and
//     2 ranges). ncu on the FP8 GEMM 1 (high, cold caches): about a third of the warps' stall
//     samples fall before the k loop (warp 0 grouping topk_ids while the others wait at the
//     barrier, then x's fp32 rows on their way from memory), and a range keeps all of that.
//   - Other stage counts (T = 1, medium / high): GEMM 2 with all six k tiles of its weights
//     requested before it waits for h (7 stages) 32.4 / 33.1 us against 26.5 / 29.2; GEMM 2 with
//     5 stages 27.7 / 33.9; GEMM 1 with 3 or 6 stages 26.6 / 29.0, 26.9 / 30.5. Larger blocks
//     leave fewer GEMM 2 blocks resident during GEMM 1. GEMM 1 with 2 stages: slower at T = 1
//     and 2. (GEMM 2 with 2 stages where that fits its grid in one wave: tiny_fewer_stages.)
//   - (2026-12-04) x's rows requested by all four warps before the grouping (x_first's loads one
//     step earlier): warp 0's read of topk_ids then waited behind them and the grouping finished
//     1 us later; FP8 at T = 1 in a chain 20.1 / 22.6 -> 20.3 / 23.2 us.
//   - (2026-12-04) the fragment pipeline of high's decode tiles (PIPE_FRAGS: step kk + 1's
//     fragments loaded while step kk's products run) in medium's too: FP8's GEMM 1 k loop at T = 1
//     10.5 us either way, BF16 at T = 64 288.5 -> 296.7 us.
// In a decode step the two GEMMs run in a chain of launches (tests/test_cuda_moe times that too):
// T = 1 23.5 / 25.7 us (76% / 69% of the copy rate), GEMM 1 alone 16.0 / 17.1, GEMM 2 alone
// 8.8 / 9.2: each streams about as a device copy of its size, and they overlap by about 1 us.
//
// GEMM mainloop: a STAGES-deep cp.async pipeline of BM x BK activation tiles (high: a hi and a lo
// tile) and BN x BK weight tiles, all BF16, in shared memory (16-byte chunks XOR-swizzled by row so
// ldmatrix is conflict-free), ldmatrix.x4 fragments (high at decode sizes: the next k16 step's
// loaded while this one's products run), one mma.sync per 16x8 output tile per k16 step and
// activation part. Tile shapes picked from the mean pairs per expert: decode (BM 16, up to 12
// pairs per expert), middle (BM 64, up to 48; high up to 96), medium's wide middle (BM 128, 48 to
// 96) and prefill (BM 128, 2 x 4 warps). An output element
// always sums its k16 products in increasing k into one fp32 accumulator (high: at each k16 step
// the hi product, then the lo one): no split-K, so a token's result is bit-identical whatever the
// batch, the routing of the others or the tile shape, in either precision.
//
// Middle sizes (H200, one run, every candidate passing the tolerance and bit-identity checks;
// weight bytes of the experts touched over time against the 1 GiB copy rate, 4225 GB/s; medium /
// high; before: the middle shape of 2 x 4 warps with 32 x 32 warp tiles, BM 64, and the decode
// shape up to 24 pairs per expert):
//   Qwen3-30B-A3B's experts      before                  now
//     16 per expert (T 256)      75.6% / 76.5% (decode)  90.6% / 84.6%  (middle)
//     32 (T 512)                 81.8% / 53.1%           85.0% / 74.0%  (middle)
//     64 (T 1024)                57.9% / 34.3%           70.4% / 45.9%  (wide / middle)
//   DeepSeek-V3 shape
//     32 (T 1024)                93.0% / 55.9%           95.3% / 75.3%
//     64 (T 2048)                56.9% / 35.9%           86.6% / 52.4%
// The old middle shape was held back by its warps: two warp rows, so at tens of rows per tile
// the second row of warps idled, and 32 x 32 warp tiles load a fragment per two products. One
// row of four warps (64 x 32 each) fixed most of it. Compiling the main loop per count of busy
// m16 tiles (BUSY_STATIC) on the old shape alone: 87.7 -> 91.6% at 16, 57.9 -> 68.4% at 64 in
// medium, 34.3 -> 40.6% in high. Also tried, at 16 / 32 / 64 per expert (Qwen3 medium, high):
//   BM 128 x BN 128, 1 x 4 warps, 4 / 3 stages, one block per SM: 71.6 / 67.0 / 57.6%,
//     58.4 / 50.2 / 35.1%; with 3 / 2 stages, two blocks per SM: 85.5 / 79.9 / 70.4%, 67.2 /
//     60.0 / 45.0% (the wide shape kept for medium: DeepSeek-V3 at 64 86.6% against 71.7%).
//   BM 64 x BN 256, 1 x 4 warps of 64 x 64, 3 stages (spills in medium's GEMM 2): 83.6 / 77.6 /
//     58.5%, 76.0 / 53.3 / 33.9%.
//   The prefill shape (BM 128 x BN 256, 2 x 4 warps of 64 x 64): 87.6 / 81.6 / 69.7%, 79.0 /
//     65.4 / 44.9%; BM 128 x BN 256 with 1 x 8 warps of 128 x 32: 83.0 / 77.5 / 68.8%, 77.1 /
//     65.7 / 44.6%.
// High at 64 per expert stays under 70%: its two products per k16 step need about 380 TFLOP/s of
// mma.sync at 70% of the copy rate, and the best shape here gives 124 (the tiles of 128 rows
// spill with both activation parts' fragments in registers).
//
// Shape letters as in kernels/ops.h; n = the pairs routed to local experts (<= T*K). D and F must
// be multiples of 8 (16-byte rows for cp.async); every model this serves has multiples of 64.
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <type_traits>
#include <cstdio>
#include <cstring>

#include "common/log.h"
#include "kernels/a2a.h"
#include "kernels/cuda/bf16_gemm.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/fp8_gemm.h"
#include "kernels/cuda/gemm_common.cuh"
#include "kernels/cuda/moe_lean.h"
#include "kernels/quant.h"

namespace cg = cooperative_groups;

typedef __nv_bfloat16 bf16;

// ---------------------------------------------------------------------------------------------
// prepare_experts
// ---------------------------------------------------------------------------------------------

#define MOE_STAGING_BYTES (32u << 20) /* each of the two pinned staging buffers */

// Checks one expert tensor: 2-D [rows, cols], a dtype we convert, data present.
static int check_expert_tensor(const tensor *t, int64_t rows, int64_t cols, const char *what,
                               int e, char *err, size_t errlen) {
    if (!t->data || t->ndim != 2 || t->shape[0] != rows || t->shape[1] != cols)
        return set_err(err, errlen, "CUDA: expert %d %s must be [%lld, %lld]", e, what,
                       (long long)rows, (long long)cols);
    if (t->dtype != DTYPE_BF16 && t->dtype != DTYPE_F16 && t->dtype != DTYPE_F32)
        return set_err(err, errlen, "CUDA: expert %d %s has dtype %s (BF16, F16 or F32 expected)",
                       e, what, dtype_name(t->dtype));
    if (t->device == DEVICE_CUDA && t->dtype != DTYPE_BF16)
        return set_err(err, errlen, "CUDA: expert %d %s is on the device in %s (BF16 expected)", e,
                       what, dtype_name(t->dtype));
    return 0;
}

// Copies host tensors into device BF16 arrays through two pinned buffers: while the DMA engine
// drains one, the host fills (or converts into) the other.
typedef struct {
    uint16_t *buf[2];
    cudaEvent_t done[2];
    int next;
} moe_stager;

static void stager_free(moe_stager *s) {
    for (int i = 0; i < 2; i++) {
        if (s->buf[i]) cudaFreeHost(s->buf[i]);
        if (s->done[i]) cudaEventDestroy(s->done[i]);
    }
}

static int stager_init(moe_stager *s) {
    memset(s, 0, sizeof *s);
    for (int i = 0; i < 2; i++)
        if (cudaHostAlloc((void **)&s->buf[i], MOE_STAGING_BYTES, cudaHostAllocDefault) !=
                cudaSuccess ||
            cudaEventCreateWithFlags(&s->done[i], cudaEventDisableTiming) != cudaSuccess) {
            cudaGetLastError();
            stager_free(s);
            memset(s, 0, sizeof *s);
            return -1;
        }
    return 0;
}

// dst[0 .. numel) (device, BF16) = t's elements as BF16. 0, or a CUDA error.
static cudaError_t stage_tensor(moe_stager *s, bf16 *dst, const tensor *t) {
    const int64_t numel = tensor_numel(t);
    cudaStream_t st = cuda_stream();
    if (t->device == DEVICE_CUDA) // already BF16 (checked)
        return cudaMemcpyAsync(dst, t->data, (size_t)numel * 2, cudaMemcpyDeviceToDevice, st);
    if (!s->buf[0] && t->dtype == DTYPE_BF16) // no pinned memory: a plain pageable copy
        return cuda_copy_to_device(dst, t->data, (size_t)numel * 2);
    const int64_t chunk = MOE_STAGING_BYTES / 2;
    for (int64_t i0 = 0; i0 < numel; i0 += chunk) {
        const int64_t n = std::min(chunk, numel - i0);
        const int k = s->next; // the staging buffer this chunk goes through
        uint16_t *b;
        if (s->buf[0]) {
            cudaError_t e = cudaEventSynchronize(s->done[k]); // its previous copy has finished
            if (e != cudaSuccess) return e;
            b = s->buf[k];
            s->next ^= 1;
        } else {
            b = (uint16_t *)xmalloc((size_t)n * 2);
        }
        if (t->dtype == DTYPE_BF16) {
            memcpy(b, (const uint16_t *)t->data + i0, (size_t)n * 2);
        } else if (t->dtype == DTYPE_F16) {
            const uint16_t *p = (const uint16_t *)t->data + i0;
            for (int64_t j = 0; j < n; j++)
                b[j] = f32_to_bf16(f16_to_f32(p[j]));
        } else {
            const float *p = (const float *)t->data + i0;
            for (int64_t j = 0; j < n; j++)
                b[j] = f32_to_bf16(p[j]);
        }
        cudaError_t e;
        if (s->buf[0]) {
            e = cudaMemcpyAsync(dst + i0, b, (size_t)n * 2, cudaMemcpyHostToDevice, st);
            if (e == cudaSuccess) e = cudaEventRecord(s->done[k], st);
        } else {
            e = cuda_copy_to_device(dst + i0, b, (size_t)n * 2);
            free(b);
        }
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

int cuda_prepare_experts(moe_experts *w, char *err, size_t errlen) {
    if (w->gate_up && w->down_all) return 0;
    const int E = w->E;
    if (E <= 0 || !w->gate || !w->up || !w->down)
        return set_err(err, errlen, "CUDA: prepare_experts needs E > 0 and the expert tensors");
    const int64_t F = w->gate[0].shape[0], D = w->gate[0].ndim == 2 ? w->gate[0].shape[1] : 0;
    for (int e = 0; e < E; e++)
        if (check_expert_tensor(&w->gate[e], F, D, "gate", e, err, errlen) ||
            check_expert_tensor(&w->up[e], F, D, "up", e, err, errlen) ||
            check_expert_tensor(&w->down[e], D, F, "down", e, err, errlen))
            return -1;
    if (D % 8 || F % 8)
        return set_err(err, errlen, "CUDA: expert sizes D=%lld F=%lld must be multiples of 8",
                       (long long)D, (long long)F);

    const size_t mat = (size_t)F * D; // elements of one [F, D] matrix
    bf16 *gate_up = nullptr, *down = nullptr;
    if (cudaMalloc(&gate_up, (size_t)E * 2 * mat * 2) != cudaSuccess ||
        cudaMalloc(&down, (size_t)E * mat * 2) != cudaSuccess) {
        cudaGetLastError();
        if (gate_up) cudaFree(gate_up);
        return set_err(err, errlen,
                       "CUDA: out of device memory for %d experts of D=%lld F=%lld in BF16 "
                       "(%.2f GiB)",
                       E, (long long)D, (long long)F, (double)E * 3 * mat * 2 / (1 << 30));
    }
    moe_stager s;
    stager_init(&s); // without pinned memory the copies go straight from pageable memory
    cudaError_t ce = cudaSuccess;
    for (int e = 0; e < E && ce == cudaSuccess; e++) {
        ce = stage_tensor(&s, gate_up + (size_t)e * 2 * mat, &w->gate[e]);
        if (ce == cudaSuccess) ce = stage_tensor(&s, gate_up + (size_t)e * 2 * mat + mat, &w->up[e]);
        if (ce == cudaSuccess) ce = stage_tensor(&s, down + (size_t)e * mat, &w->down[e]);
    }
    if (ce == cudaSuccess) ce = cudaStreamSynchronize(cuda_stream());
    stager_free(&s);
    if (ce != cudaSuccess) {
        cudaFree(gate_up);
        cudaFree(down);
        return set_err(err, errlen, "CUDA: copying the expert weights to the device: %s",
                       cudaGetErrorString(ce));
    }
    w->gate_up = gate_up;
    w->down_all = down;
    w->wdtype = DTYPE_BF16;
    return 0;
}

// NVFP4 weights as the W4A16 kernels read them, rearranged in place once at load; a thread per
// 64 k of a row (32 code bytes, 4 group scales).
//  - Codes: lane t (of a quad) of the mma B fragment takes the row's k 16s + 2t + {0, 1} (b0)
//    and 16s + 8 + 2t + {0, 1} (b1) at k16 step s, so its 16 values of the chunk become its own
//    8 bytes [8t, 8t + 8): word w (steps 2w, 2w + 1) holds fragment register j = 2 (s - 2w) + b,
//    its even k's code in the low half, each code bit where wq_code_pos puts it, so that
//    rotations and masks put sign and magnitude in place for BF16 (wq_decode).
//  - Group scales: E4M3 s becomes u8 c with (c << 4) + WQ_SF_BIAS the BF16 bits of s 2^119
//    (exact: 3 mantissa bits; subnormal s made normal). A zero scale becomes c = 0 and its
//    group's codes +0, so the products are 0 as e2m1(q) 0 is (up to the sign of a zero).
// A negative or NaN scale sets *bad.

__global__ void nvfp4_pack_kernel(uint8_t *q, uint8_t *sf, int64_t n_chunks, int *bad) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_chunks) return;
    uint4 *qp = reinterpret_cast<uint4 *>(q + i * 32);
    const uint4 v0 = qp[0], v1 = qp[1];
    const uint32_t in[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
    uint32_t *sp = reinterpret_cast<uint32_t *>(sf + i * 4);
    const uint32_t sw = *sp;
    uint32_t sc = 0;
    bool zero[4];
    for (int s = 0; s < 4; s++) {
        const float f = fp8_e4m3_to_float((uint8_t)(sw >> (8 * s)));
        zero[s] = f == 0.0f;
        if (!(f >= 0.0f)) atomicExch(bad, 1);
        if (f > 0.0f) {
            const uint32_t bits = __float_as_uint(ldexpf(f, WQ_SF_EXP)) >> 16;
            sc |= ((bits - WQ_SF_BIAS) >> 4) << (8 * s);
        }
    }
    uint32_t out[8];
    wq_pack_chunk(out, in, zero);
    qp[0] = make_uint4(out[0], out[1], out[2], out[3]);
    qp[1] = make_uint4(out[4], out[5], out[6], out[7]);
    *sp = sc;
}

// The quantized experts' upload: n host arrays into new device buffers dst[i] (sizes[i] bytes),
// then pack(bad) queued on the backend's stream (the in-place rearrangement, which sets *bad on a
// value it refuses) and *bad_h read back. On an error or *bad_h every buffer is freed.
template <class Pack>
static cudaError_t upload_packed(int n, const void *const *src, const size_t *sizes, void **dst,
                                 Pack pack, int *bad_h) {
    int *bad = nullptr;
    *bad_h = 0;
    cudaError_t ce = cudaMalloc(&bad, sizeof(int));
    if (ce == cudaSuccess) ce = cuda_zero_device(bad, sizeof(int));
    for (int i = 0; i < n && ce == cudaSuccess; i++) {
        ce = cudaMalloc(&dst[i], sizes[i]);
        if (ce == cudaSuccess) ce = cuda_copy_to_device(dst[i], src[i], sizes[i]);
    }
    if (ce == cudaSuccess) {
        pack(bad);
        ce = cudaGetLastError();
    }
    if (ce == cudaSuccess)
        ce = cudaMemcpyAsync(bad_h, bad, sizeof(int), cudaMemcpyDeviceToHost, cuda_stream());
    if (ce == cudaSuccess) ce = cudaStreamSynchronize(cuda_stream());
    if (bad) cudaFree(bad);
    if (ce != cudaSuccess || *bad_h) {
        cudaGetLastError();
        for (int i = 0; i < n; i++)
            if (dst[i]) cudaFree(dst[i]), dst[i] = nullptr;
    }
    return ce;
}

// The five device buffers of NVFP4 experts (codes and scales of gate_up, then of down, then s2)
// into w, in the given layout.
static void set_nvfp4_buffers(moe_experts *w, void *const dst[5], int wformat) {
    w->gate_up = dst[0];
    w->gate_up_sf = dst[1];
    w->down_all = dst[2];
    w->down_sf = dst[3];
    w->s2 = (float *)dst[4];
    w->wdtype = DTYPE_U8;
    w->wformat = wformat;
}

// MOESERVE_NVFP4_SM100=1 on a compute capability 10.0 device, shapes of multiples of 256: the
// experts in MOE_W_NVFP4_SM100's layout for Blackwell's NVFP4 x NVFP4 path (nvfp4_sm100.cu),
// opt-in until a Blackwell GPU has run tests/test_cuda_nvfp4_sm100.
static bool nvfp4_sm100_wanted(int D, int F) {
    const char *e = getenv("MOESERVE_NVFP4_SM100");
    return e && strcmp(e, "1") == 0 && D % 256 == 0 && F % 256 == 0 && cuda_nvfp4_sm100_available();
}

// The checkpoint's codes as they are, the group scales in atoms (a negative zero made +0; a
// negative or NaN scale refused), and s2 as a tensor scale a 128 rows: gate_up's [E, 2F / 128],
// then down's [E, D / 128].
static int prepare_nvfp4_sm100(moe_experts *w, const uint8_t *gate_up_q, const uint8_t *gate_up_sf,
                               const uint8_t *down_q, const uint8_t *down_sf, const float *s2,
                               int D, int F, char *err, size_t errlen) {
    const int E = w->E;
    const int64_t gu_rows = (int64_t)E * 2 * F, dn_rows = (int64_t)E * D;
    const size_t n_s2 = (size_t)(gu_rows + dn_rows) / 128;
    const size_t sizes[5] = {(size_t)gu_rows * D / 2, quant_nvfp4_sf_atoms_bytes(gu_rows, D),
                             (size_t)dn_rows * F / 2, quant_nvfp4_sf_atoms_bytes(dn_rows, F),
                             n_s2 * sizeof(float)};
    uint8_t *sf = (uint8_t *)malloc(std::max(gu_rows * D, dn_rows * F) / 16);
    uint8_t *gu_at = (uint8_t *)malloc(sizes[1]), *dn_at = (uint8_t *)malloc(sizes[3]);
    float *s2b = (float *)malloc(sizes[4]);
    const char *bad = nullptr;
    if (!sf || !gu_at || !dn_at || !s2b) bad = "out of host memory";
    for (int m = 0; m < 2 && !bad; m++) { // gate_up, then down
        const int64_t n = m ? dn_rows * F / 16 : gu_rows * D / 16;
        const uint8_t *src = m ? down_sf : gate_up_sf;
        for (int64_t i = 0; i < n && !bad; i++) {
            sf[i] = src[i] == 0x80 ? 0 : src[i];
            if (sf[i] & 0x80 || (sf[i] & 0x7f) == 0x7f)
                bad = "a group scale (weight_scale) is negative or NaN";
        }
        if (!bad) quant_nvfp4_sf_atoms(m ? dn_at : gu_at, sf, m ? dn_rows : gu_rows, m ? F : D);
    }
    for (int e = 0; e < E && !bad; e++) {
        for (int b = 0; b < 2 * F / 128; b++) // the gate's rows, then the up's
            s2b[(size_t)e * (2 * F / 128) + b] = s2[3 * e + (b < F / 128 ? 0 : 1)];
        for (int b = 0; b < D / 128; b++)
            s2b[(size_t)gu_rows / 128 + (size_t)e * (D / 128) + b] = s2[3 * e + 2];
        for (int k = 0; k < 3; k++)
            if (!(fabsf(s2[3 * e + k]) < INFINITY)) bad = "a weight_scale_2 is not finite";
    }
    free(sf);
    void *dst[5] = {};
    cudaError_t ce = cudaSuccess;
    const void *src[5] = {gate_up_q, gu_at, down_q, dn_at, s2b};
    int bad_h = 0;
    if (!bad)
        ce = upload_packed(
            5, src, sizes, dst, [](int *) {}, &bad_h); // as they are
    free(gu_at);
    free(dn_at);
    free(s2b);
    if (bad || ce != cudaSuccess)
        return set_err(err, errlen, "CUDA: NVFP4 experts of D=%d F=%d for Blackwell: %s", D, F,
                       bad ? bad : cudaGetErrorString(ce));
    set_nvfp4_buffers(w, dst, MOE_W_NVFP4_SM100);
    LOG_WARN("cuda", "NVFP4 experts on Blackwell's tcgen05 path (MOESERVE_NVFP4_SM100=1): not yet "
                     "checked on a Blackwell GPU");
    return 0;
}

int cuda_prepare_experts_nvfp4(moe_experts *w, const uint8_t *gate_up_q,
                               const uint8_t *gate_up_sf, const uint8_t *down_q,
                               const uint8_t *down_sf, const float *s2, int D, int F, char *err,
                               size_t errlen) {
    const int E = w->E;
    if (E <= 0 || D <= 0 || F <= 0 || D % 64 || F % 64)
        return set_err(err, errlen, "CUDA: NVFP4 experts need E > 0 and D=%d, F=%d multiples of 64",
                       D, F);
    if (nvfp4_sm100_wanted(D, F))
        return prepare_nvfp4_sm100(w, gate_up_q, gate_up_sf, down_q, down_sf, s2, D, F, err,
                                   errlen);
    const size_t mat = (size_t)F * D; // elements of one [F, D] matrix
    const size_t sizes[5] = {(size_t)E * mat, (size_t)E * mat / 8, (size_t)E * mat / 2,
                             (size_t)E * mat / 16, (size_t)E * 3 * sizeof(float)};
    // the tensor scales times 2^(126 - WQ_SF_EXP), what the decoded weights lack
    float *s2k = (float *)malloc(sizes[4]);
    if (!s2k) return set_err(err, errlen, "CUDA: out of host memory for %d tensor scales", 3 * E);
    for (int i = 0; i < 3 * E; i++) {
        s2k[i] = ldexpf(s2[i], 126 - WQ_SF_EXP);
        if (!(fabsf(s2k[i]) < INFINITY)) {
            free(s2k);
            return set_err(err, errlen, "CUDA: NVFP4 expert %d: weight_scale_2 %g is out of range",
                           i / 3, (double)s2[i]);
        }
    }
    const void *src[5] = {gate_up_q, gate_up_sf, down_q, down_sf, s2k};
    void *dst[5] = {};
    int bad_h = 0;
    const cudaError_t ce = upload_packed(5, src, sizes, dst, [&](int *bad) {
        for (int m = 0; m < 2; m++) { // gate_up, then down
            const int64_t n_chunks = (int64_t)(m ? 1 : 2) * E * (int64_t)mat / 64;
            nvfp4_pack_kernel<<<(unsigned)((n_chunks + 255) / 256), 256, 0, cuda_stream()>>>(
                (uint8_t *)dst[2 * m], (uint8_t *)dst[2 * m + 1], n_chunks, bad);
        }
    }, &bad_h);
    free(s2k);
    if (ce != cudaSuccess || bad_h) {
        if (bad_h)
            return set_err(err, errlen, "CUDA: NVFP4 experts of D=%d F=%d: a group scale "
                                        "(weight_scale) is negative or NaN", D, F);
        return set_err(err, errlen, "CUDA: copying %d NVFP4 experts of D=%d F=%d: %s", E, D, F,
                       cudaGetErrorString(ce));
    }
    set_nvfp4_buffers(w, dst, MOE_W_NVFP4);
    return 0;
}

// FP8 weights as the W8A16 kernels read them (fp8_w8_pack64 of kernels/quant.h), in place; a
// thread per 64 k of a row. A NaN code (S.1111.111) sets *bad: decoded it would be 480.
__global__ void fp8_pack_kernel(uint8_t *q, int64_t n_chunks, int *bad) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_chunks) return;
    uint4 *qp = reinterpret_cast<uint4 *>(q + i * 64);
    uint4 in[4], out[4];
    for (int c = 0; c < 4; c++)
        in[c] = qp[c];
    const uint8_t *src = reinterpret_cast<const uint8_t *>(in);
    for (int k = 0; k < 64; k++)
        if ((src[k] & 0x7f) == 0x7f) atomicExch(bad, 1);
    fp8_w8_pack64(reinterpret_cast<uint8_t *>(out), src);
    for (int c = 0; c < 4; c++)
        qp[c] = out[c];
}

// Whether the n block scales at s are all finite (FP8 weights' weight_scale_inv: the W8A16 kernels
// multiply sums by them as they are).
static bool fp8_scales_finite(const float *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!(fabsf(s[i]) < INFINITY)) return false;
    return true;
}

int cuda_prepare_experts_fp8(moe_experts *w, const uint8_t *gate_up_q, const float *gate_up_s,
                             const uint8_t *down_q, const float *down_s, int D, int F, char *err,
                             size_t errlen) {
    const int E = w->E;
    if (E <= 0 || D <= 0 || F <= 0 || D % 64 || F % 64)
        return set_err(err, errlen, "CUDA: FP8 experts need E > 0 and D=%d, F=%d multiples of 64",
                       D, F);
    const size_t mat = (size_t)F * D; // elements of one [F, D] matrix
    const int64_t nkd = (D + QUANT_FP8_BLOCK - 1) / QUANT_FP8_BLOCK,
                  nkf = (F + QUANT_FP8_BLOCK - 1) / QUANT_FP8_BLOCK;
    const size_t sizes[4] = {(size_t)E * 2 * mat, (size_t)E * nkd * 2 * F * sizeof(float),
                             (size_t)E * mat, (size_t)E * nkf * D * sizeof(float)};
    const float *scales[2] = {gate_up_s, down_s};
    for (int m = 0; m < 2; m++)
        if (!fp8_scales_finite(scales[m], sizes[2 * m + 1] / sizeof(float)))
            return set_err(err, errlen, "CUDA: FP8 experts of D=%d F=%d: a block scale "
                                        "(weight_scale_inv) of the %s is not finite",
                           D, F, m ? "down projections" : "gate / up projections");
    const void *src[4] = {gate_up_q, gate_up_s, down_q, down_s};
    void *dst[4] = {};
    int bad_h = 0;
    const cudaError_t ce = upload_packed(4, src, sizes, dst, [&](int *bad) {
        for (int m = 0; m < 2; m++) { // gate_up, then down
            const int64_t n_chunks = (int64_t)sizes[2 * m] / 64;
            fp8_pack_kernel<<<(unsigned)((n_chunks + 255) / 256), 256, 0, cuda_stream()>>>(
                (uint8_t *)dst[2 * m], n_chunks, bad);
        }
    }, &bad_h);
    if (ce != cudaSuccess || bad_h) {
        if (bad_h)
            return set_err(err, errlen, "CUDA: FP8 experts of D=%d F=%d: a weight code is NaN", D,
                           F);
        return set_err(err, errlen, "CUDA: copying %d FP8 experts of D=%d F=%d: %s", E, D, F,
                       cudaGetErrorString(ce));
    }
    w->gate_up = dst[0];
    w->gate_up_sf = dst[1];
    w->down_all = dst[2];
    w->down_sf = dst[3];
    w->s2 = nullptr;
    w->wdtype = DTYPE_U8;
    w->wformat = MOE_W_FP8;
    return 0;
}

// ---------------------------------------------------------------------------------------------
// moe_experts: the grouping (prepare kernel)
// ---------------------------------------------------------------------------------------------

#define MOE_PREP_THREADS   1024
#define MOE_PREP_SMEM_INTS    12000 /* block 0's counts and offsets, at most (shared memory) */
#define PREP_IDS           8     /* rounds of 32 pairs whose expert ids a warp loads at once */
#define MOE_PREP_STAGE        16384 /* pairs up to which block 0 groups the rows in shared memory */
#define MOE_PREP_AFTER_BLOCKS 128   /* conversion blocks from which moe_convert_kernel converts */

// The prepare kernel's row of counts a segment: E rounded up to odd, so that a warp reading one
// expert's counts of 32 segments meets 32 banks.
static __host__ __device__ __forceinline__ int prep_row_stride(int E) { return E | 1; }

typedef struct {
    int32_t *offsets;        // [E + 1] first grouped row of each expert; offsets[E] = n
    int32_t *pairs;          // [T*K] pair id (t * K + k) of each grouped row, rows [0, n)
    int4 *tiles;             // [max_tiles] {expert, row0, row1, 0}
    int32_t *n_tiles;        // [1]
    bf16 *xb;                // [T, D] x in BF16
    bf16 *xb_lo;             // [T, D] x - xb in BF16 (high), or NULL (medium)
    const float *x;          // [T, D]
    const int32_t *topk_ids; // [T, K]; NULL: every pair to expert 0 (linear_bi's one weight)
    int64_t n_x8;            // T * D / 8
    int n_pairs;             // T * K
    int E, BM, S;            // S: warps that each count and scatter one segment of the pairs
    const int32_t *n_rows;   // NULL, or the rows to group (device; pairs of later rows skipped)
    int K;
    int convert_after; // 1: x is converted by moe_convert_kernel, launched after the count
} moe_prep_args;

// The lanes of the warp whose e equals this lane's (e < 2^bits, or negative: the lanes of any
// negative e), from a ballot a bit. The same as __match_any_sync, whose cost on the H200 grew
// with the distinct values of the warp (the grouping's scatter at 8192 pairs over 128 experts
// spent about 7 us in 256 of them).
__device__ __forceinline__ unsigned warp_match(int e, int bits) {
    const unsigned valid = __ballot_sync(0xffffffffu, e >= 0);
    unsigned same = e >= 0 ? valid : ~valid;
    for (int j = 0; j < bits; j++) {
        const bool set = (e >> j) & 1;
        const unsigned b = __ballot_sync(0xffffffffu, set);
        same &= set ? b : ~b;
    }
    return same;
}

// x [T, D] into xb (high: and its lo part), 8 values a thread a step, block b of nb.
__device__ __forceinline__ void prep_convert(const moe_prep_args &a, int b, int nb) {
    const int64_t step = (int64_t)nb * blockDim.x;
    for (int64_t i = (int64_t)b * blockDim.x + threadIdx.x; i < a.n_x8; i += step) {
        const float4 p = reinterpret_cast<const float4 *>(a.x)[2 * i];
        const float4 q = reinterpret_cast<const float4 *>(a.x)[2 * i + 1];
        uint4 v;
        if (a.xb_lo) {
            uint4 r;
            split_bf16x8(p, q, &v, &r);
            reinterpret_cast<uint4 *>(a.xb_lo)[i] = r;
        } else {
            v = pack_bf16x8(p, q);
        }
        reinterpret_cast<uint4 *>(a.xb)[i] = v;
    }
}

// The conversion of x after the count (convert_after): launched with programmatic dependent
// launch behind the prepare kernel, whose one block lets it start once its expert ids are in (so
// that their loads do not queue behind the conversion's); its block 0 waits for the grouping at
// its end, so this grid completes after it and GEMM 1, waiting for this grid, sees both, while
// the other blocks leave their multiprocessors to GEMM 1 as soon as they have converted. (It
// writes xb before that wait: nothing the prepare kernel or any kernel still running reads; the
// prepare kernel itself was launched the ordinary way, after every kernel before it.)
__global__ void __launch_bounds__(MOE_PREP_THREADS) moe_convert_kernel(moe_prep_args a) {
    pdl_trigger(); // GEMM 1 may take its place on the SMs; it waits for this grid
    prep_convert(a, blockIdx.x, gridDim.x);
    if (blockIdx.x == 0) pdl_wait();
}

// Exclusive prefix sum over the warp's lanes in lane order; *sum = the warp's total.
__device__ __forceinline__ int warp_exclusive_scan(int v, int *sum) {
    const int lane = threadIdx.x & 31;
    int inc = v;
    for (int o = 1; o < 32; o <<= 1) {
        const int n = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += n;
    }
    *sum = __shfl_sync(0xffffffffu, inc, 31);
    return inc - v;
}

// Block 0 groups the pairs by expert; blocks 1.. convert x to BF16 meanwhile (high: also x_lo).
// The grouping is a counting sort with a segment of the pairs a warp: count per (segment,
// expert) by shared atomics, whose return values rank each pair among its expert's of the
// segment; per expert, the segments' bases by a warp's scan over them; the offsets and tiles by
// one warp's scan over the experts; then each pair's row is its expert's first plus its
// segment's base plus its rank. (Where a segment is more than one load of ids, PREP_IDS rounds,
// its ranks are not kept: the warp walks its segment again, the lanes of one expert taking
// consecutive rows in lane order, warp_match.) Up to MOE_PREP_STAGE pairs the rows are placed in
// shared memory and copied out in order. Where the conversion comes after (convert_after), only
// block 0 runs, and it lets moe_convert_kernel start once it has counted. (Its registers, over 32 a
// thread, leave no room on block 0's multiprocessor for a block of that kernel; blocks 1.. convert
// only up to MOE_PREP_AFTER_BLOCKS of them, one wave at a block an SM.) H200, Qwen3-30B-A3B's
// experts at T = 1024 (8192 pairs), high, the block's clock in a call (globaltimer, us from the
// launch): before, the count ended at 4.5 (its ids' loads queued behind the conversion's 16 MB),
// the scatter took 8.2 and the block ended at 16.2; with the ballots and the staged rows the
// scatter took 3.3 to 4.4, with the conversion after the count the count ended at 1.9 to 2.1, and
// GEMM 1 started at 11.9 to 12.6 (16.7 to 17.4 before). The ranks from the count's atomics in place
// of the second walk: test_cuda_moe --bf16-timing 1024, medium 375.0 to 377.6 us against 380.5 to
// 382.9 (the same call; high 414.4 to 415.8 against 416.5 to 418.1, with the swapped kernel's tiles
// in their new order).
__global__ void __launch_bounds__(MOE_PREP_THREADS, 1) moe_prepare_kernel(moe_prep_args a) {
    if (!a.convert_after) pdl_trigger(); // GEMM 1 may take its place on the SMs; it waits for us
    if (blockIdx.x > 0) {
        prep_convert(a, blockIdx.x - 1, gridDim.x - 1);
        return;
    }
    extern __shared__ int sm[];
    const int E = a.E, S = a.S, RS = prep_row_stride(E), tid = threadIdx.x, nthr = blockDim.x;
    const int lane = tid & 31, warp = tid >> 5, bits = E > 1 ? 32 - __clz(E - 1) : 0;
    // moe_experts_n: the pairs of rows 0..*n_rows-1 only (the rest are as skipped slots)
    const int n_pairs = a.n_rows ? min(a.n_pairs, max(0, __ldcg(a.n_rows)) * a.K) : a.n_pairs;
    int *cnt = sm;              // [S, RS] pairs of segment s for expert e, then its next row
    int *off = cnt + S * RS;    // [E + 1] pairs per expert, then first row per expert
    int *toff = off + E + 1;    // [E + 1] first tile per expert
    int *rows_s = toff + E + 1; // [n_pairs] the grouped pair ids, when staged
    const bool stage = a.n_pairs <= MOE_PREP_STAGE;

    // the expert ids of pairs base + lane, + 32, ... (PREP_IDS of them, -1 past s1), requested at
    // once: one wait for memory a PREP_IDS rounds, not one a round (H200, 8192 pairs: the
    // grouping took 20 us with a load a round); a segment's first are requested before the
    // counts are cleared, and kept for the scatter when they are the whole segment
    const int seg = (a.n_pairs + S - 1) / S;
    const int s0 = warp * seg, s1 = min(n_pairs, s0 + seg);
    const bool one_load = seg <= 32 * PREP_IDS;
    int ids[PREP_IDS];
    int rank[PREP_IDS]; // one_load: each pair's place among its expert's pairs of the segment
    auto load_ids = [&](int base) {
#pragma unroll
        for (int j = 0; j < PREP_IDS; j++) {
            const int i = base + 32 * j + lane;
            ids[j] = i < s1 ? (a.topk_ids ? a.topk_ids[i] : 0) : -1;
        }
    };
    if (warp < S) load_ids(s0);
    for (int i = tid; i < S * RS; i += nthr)
        cnt[i] = 0;
    __syncthreads();

    // 1. count per (segment, expert)
    if (warp < S)
        for (int base = s0; base < s1; base += 32 * PREP_IDS) {
            if (base != s0) load_ids(base);
#pragma unroll
            for (int j = 0; j < PREP_IDS; j++) {
                const int e = ids[j];
                rank[j] = 0;
                if (e >= 0) {
                    if (e >= E) __trap(); // broken invariant: ids index the local experts
                    rank[j] = atomicAdd(&cnt[warp * RS + e], 1);
                }
            }
        }
    __syncthreads();
    if (a.convert_after) pdl_trigger(); // the conversion of x may start

    // 2. per expert (a warp each): the segments' bases, exclusive in segment order (RS is odd, so
    //    the lanes' rows fall in distinct banks), and the expert's total
    for (int e = warp; e < E; e += nthr / 32) {
        int total;
        const int c = lane < S ? cnt[lane * RS + e] : 0;
        const int b = warp_exclusive_scan(c, &total);
        if (lane < S) cnt[lane * RS + e] = b;
        if (lane == 0) off[e] = total;
    }
    __syncthreads();
    // 3. warp 0: the first row and the first tile of each expert, lane l over a run of experts
    if (warp == 0) {
        const int per = (E + 31) / 32, e0 = min(E, lane * per), e1 = min(E, e0 + per);
        int rows = 0, tiles = 0;
        for (int e = e0; e < e1; e++) {
            rows += off[e];
            tiles += (off[e] + a.BM - 1) / a.BM;
        }
        int sum_rows, sum_tiles;
        rows = warp_exclusive_scan(rows, &sum_rows);
        tiles = warp_exclusive_scan(tiles, &sum_tiles);
        for (int e = e0; e < e1; e++) {
            const int c = off[e];
            off[e] = rows;
            toff[e] = tiles;
            rows += c;
            tiles += (c + a.BM - 1) / a.BM;
        }
        if (lane == 0) {
            off[E] = sum_rows;
            toff[E] = sum_tiles;
            *a.n_tiles = sum_tiles;
        }
    }
    __syncthreads();
    // 4. the offsets and the tile table: expert e's tiles of BM rows from its first row
    for (int e = tid; e <= E; e += nthr)
        a.offsets[e] = off[e];
    for (int e = tid; e < E; e += nthr) {
        const int r1 = off[e + 1];
        for (int r0 = off[e], t = toff[e]; r0 < r1; r0 += a.BM, t++)
            a.tiles[t] = make_int4(e, r0, min(r0 + a.BM, r1), 0);
    }

    // 5. scatter: a pair's row is its expert's first, plus its segment's base, plus its rank
    //    (one_load: the count's); else each warp walks its segment again in the same rounds and
    //    the lanes of one expert take consecutive rows in lane order
    int *dst = stage ? rows_s : a.pairs;
    if (warp < S && one_load) {
#pragma unroll
        for (int j = 0; j < PREP_IDS; j++) {
            const int e = ids[j];
            if (e >= 0) dst[off[e] + cnt[warp * RS + e] + rank[j]] = s0 + 32 * j + lane;
        }
    } else if (warp < S)
        for (int base = s0; base < s1; base += 32 * PREP_IDS) {
            load_ids(base);
#pragma unroll
            for (int j = 0; j < PREP_IDS; j++) {
                const int e = ids[j];
                const unsigned same = warp_match(e, bits);
                const int rank = __popc(same & ((1u << lane) - 1u));
                if (e >= 0) dst[off[e] + cnt[warp * RS + e] + rank] = base + 32 * j + lane;
                __syncwarp();
                if (e >= 0 && rank == 0) cnt[warp * RS + e] += __popc(same);
                __syncwarp();
            }
        }
    if (stage) { // the grouped rows out in order
        __syncthreads();
        for (int i = tid; i < off[E]; i += nthr)
            a.pairs[i] = rows_s[i];
    }
}

// ---------------------------------------------------------------------------------------------
// moe_experts: the grouped GEMMs
// ---------------------------------------------------------------------------------------------

// SPLIT: the high precision (activation tiles in two parts, hi and lo).
// BUSY_STATIC: the main loop is compiled once per count of busy m16 row tiles (0..MI) and the
// block takes the copy for its own count, so the loop is straight-line code without the per-tile
// branches, and in medium the mma.sync asm is not volatile (the compiler may move products past
// the next fragment loads). Neither changes an instruction's operands or the order of any sum.
// ONE: high precision's hi and lo products in one chain through the tensor cores' accumulator
// (acc = lo w + (hi w + acc) a k16 step), the sums of the wgmma kernels (bf16_gemm.cu), so that
// a token's rows are the same bits at every size (see moe_experts_path).
// QSTAGES: the FP8 and NVFP4 weights' stage count (0: from the shared memory, moe_b_layout).
template <int BM_, int BN_, int BK_, int WARPS_M_, int WARPS_N_, int STAGES_, bool SPLIT_,
          bool BUSY_STATIC_ = false, bool ONE_ = false, int QSTAGES_ = 0>
struct moe_tile_cfg {
    static constexpr int BM = BM_, BN = BN_, BK = BK_, WARPS_M = WARPS_M_, WARPS_N = WARPS_N_,
                         STAGES = STAGES_, QSTAGES = QSTAGES_;
    static constexpr bool SPLIT = SPLIT_, BUSY_STATIC = BUSY_STATIC_, ONE = ONE_;
    static constexpr int A_PARTS = SPLIT ? 2 : 1; // activation tiles per stage
    // high with few output tiles per warp (decode): fragments double-buffered across k16 steps
    static constexpr bool PIPE_FRAGS = SPLIT && (BM_ / WARPS_M_ / 16) * (BN_ / WARPS_N_ / 8) <= 4;
    static constexpr int threads = WARPS_M * WARPS_N * 32;
    static constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N; // one warp's output tile
    static constexpr int MI = WM / 16, NI = WN / 8;            // its m16 and n8 tiles
    static constexpr int CPR = BK / 8;                         // 16-byte chunks per tile row
    static constexpr int ROWS_PER_PASS = threads / CPR;        // tile rows one load pass covers
    static constexpr int A_ITERS = BM / ROWS_PER_PASS, B_ITERS = BN / ROWS_PER_PASS;
    static constexpr size_t smem = (size_t)STAGES * (A_PARTS * BM + BN) * BK * sizeof(bf16);
    static_assert(WM % 16 == 0 && WN % 16 == 0, "warp tile: m16 rows, pairs of n8 columns");
    static_assert(BK % 16 == 0 && CPR >= 8 && threads % CPR == 0, "k tile");
    static_assert(BM % ROWS_PER_PASS == 0 && BN % ROWS_PER_PASS == 0, "load passes");
    static_assert(STAGES >= 2, "pipeline");
    static_assert(!ONE || SPLIT, "one chain: high precision");
    static_assert(smem <= 227 * 1024, "shared memory of one block");
};

// Decode: few rows per expert, the weights stream through once; many blocks, deep prefetch.
typedef moe_tile_cfg<16, 64, 128, 1, 4, 4, false> moe_cfg_decode;
// Between: tens of rows per expert. Four warps side by side, each with all 64 rows (64 x 32 warp
// tiles): every warp has the tile's busy rows, and each weight fragment meets four activation
// fragments. Wide (medium, 48 to 96 pairs per expert): a tile holds all of most experts' rows,
// so the weights stream once; 128 x 32 warp tiles.
typedef moe_tile_cfg<64, 128, 64, 1, 4, 4, false, true> moe_cfg_mid;
typedef moe_tile_cfg<128, 128, 64, 1, 4, 3, false, true> moe_cfg_mid_wide;
// Prefill: hundreds of rows per expert, bound by the tensor cores; 64 x 64 warp tiles keep the
// ldmatrix traffic under the mma rate.
typedef moe_tile_cfg<128, 256, 64, 2, 4, 4, false> moe_cfg_prefill;
// High: the same tiles with the lo activation tile beside the hi one, one stage less.
// Decode: 72 KB, three blocks per SM. On the H200 with Qwen3-30B-A3B's experts it matched medium
// from T = 64 up, where 4 stages at two blocks per SM took 13-25% longer; with DeepSeek-V3's at
// T = 1, whose blocks stream 7168-long rows in under two waves, 4 stages were the faster (7% over
// medium against 23%).
// Middle: 96 KB, two blocks per SM as in medium. Prefill: 192 KB, as much as medium's 4 stages.
typedef moe_tile_cfg<16, 64, 128, 1, 4, 3, true> moe_cfg_decode_high;
typedef moe_tile_cfg<64, 128, 64, 1, 4, 3, true, true> moe_cfg_mid_high;
typedef moe_tile_cfg<128, 256, 64, 2, 4, 3, true> moe_cfg_prefill_high;

// A tile shape with another k tile and stage counts. None changes a sum: the stages only pace
// the loads, and every output sums its k16 products in increasing k whatever BK is (FP8: BK
// within a 128-k block, whose scale applies to its sums).
template <class C, int BK, int STAGES, int QSTAGES = C::QSTAGES>
using moe_cfg_with = moe_tile_cfg<C::BM, C::BN, BK, C::WARPS_M, C::WARPS_N, STAGES, C::SPLIT,
                                  C::BUSY_STATIC, C::ONE, QSTAGES>;

typedef struct {
    const bf16 *act;       // GATE_UP: xb [T, Kd] (rows gathered through pairs); else h [n, Kd]
    int64_t act_lo;        // high: elements from act to its lo part (same layout); else 0
    int64_t h_lo;          // high: elements from h to its lo part [n, N]; else 0
    const bf16 *w;         // GATE_UP: gate_up [E, 2N, Kd]; else down [E, N, Kd]
    const int4 *tiles;     // [n_tiles]
    const int32_t *n_tiles;
    const int32_t *pairs;  // [n]
    bf16 *h;               // GATE_UP's output [n, N]
    float *out;            // the down GEMM's output [T*K, N], rows addressed by pair id
    int Kd, N, topk;       // reduction length; output columns (F or D); K of top-k
    int n_col_blocks;      // N-blocks per tile
    // The tiny path (TINY kernels, T*K <= 32): each block groups topk_ids itself, h rows are pair
    // ids, GEMM 1 converts its rows of x on the fly (no prepare kernel).
    const float *x;             // GEMM 1: [T, Kd]
    const int32_t *topk_ids;    // [n_pairs]
    int n_pairs, E;             // T * K; local experts
    const int32_t *n_rows;      // TINY, moe_experts_n: the rows to take (device), or NULL
    int tile_rows;              // rows per tile (GEMM 1: R1, its x rows held for all of Kd)
    // linear_bi (GEMM 2 form, not TINY): Kd cut into n_splits ranges of nk_split k tiles, one
    // block each; with n_splits > 1 split s writes its sums to part + s * part_stride (rows by
    // pair id, as out) and a reduction adds them in split order. wait_first: the kernel before is
    // the prepare kernel itself, so the tile table is read only after pdl_wait.
    // cluster (bi_run_small): the S ranges of an N-block are one thread-block cluster (blocks
    // c * S + split), and instead of part they add their sums in split order through each other's
    // shared memory.
    int n_splits, nk_split;
    float *part;
    int64_t part_stride;
    int wait_first;
    int cluster;
    // WF_NVFP4: the codes [E, rows, Kd / 2] and E4M3 group scales [E, rows, Kd / 16] of w's rows
    // (rows: 2N for GATE_UP, N), and the tensor scales [E, 3] (gate, up, down). WF_FP8: the codes
    // [E, rows, Kd] and (wsf) fp32 scales [E, ceil(Kd / 128), rows].
    const uint8_t *wq, *wsf;
    const float *ws2;
} moe_gemm_args;

__device__ __forceinline__ void ldmatrix_x4(uint32_t *r, uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void mma_bf16_16816(float *c, const uint32_t *a, const uint32_t *b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// d = a b, from a zero accumulator.
__device__ __forceinline__ void mma_bf16_16816_zero(float *d, const uint32_t *a,
                                                    const uint32_t *b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%10, %10, %10, %10};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(0.0f));
}
// The same two, not volatile: pure functions of their registers, free to be scheduled.
__device__ __forceinline__ void mma_bf16_16816_nv(float *c, const uint32_t *a, const uint32_t *b) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_bf16_16816_zero_nv(float *d, const uint32_t *a,
                                                       const uint32_t *b) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%10, %10, %10, %10};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(0.0f));
}
template <bool NV>
__device__ __forceinline__ void mma_acc(float *c, const uint32_t *a, const uint32_t *b) {
    if constexpr (NV)
        mma_bf16_16816_nv(c, a, b);
    else
        mma_bf16_16816(c, a, b);
}
template <bool NV>
__device__ __forceinline__ void mma_zero(float *d, const uint32_t *a, const uint32_t *b) {
    if constexpr (NV)
        mma_bf16_16816_zero_nv(d, a, b);
    else
        mma_bf16_16816_zero(d, a, b);
}

// f(std::integral_constant<int, v>{}) for the v in [0, N] that equals n (nothing if none does).
template <int N, class Fn> __device__ __forceinline__ void with_static_count(int n, Fn &&f) {
    if constexpr (N >= 0) {
        if (n == N) {
            f(std::integral_constant<int, N>{});
            return;
        }
        with_static_count<N - 1>(n, f);
    }
}

// Element offset of 16-byte chunk ch of row r in a [rows, BK] tile: chunks XOR-swizzled by r % 8.
template <int BK> __device__ __forceinline__ int swz(int r, int ch) {
    return r * BK + ((ch ^ (r & 7)) << 3);
}

// WQ: gemm_common.cuh's wq_decode, bf16x2_mul and wq_scale2 decode the NVFP4 fragments.

// The weights' formats (template argument WF): BF16, NVFP4 (W4A16), FP8 (W8A16).
enum { WF_BF16 = 0, WF_NVFP4 = 1, WF_FP8 = 2 };

// WF_NVFP4: a stage holds a B tile's codes [BN, BK / 2] and group scales [BN, BK / 16] (9/32 of
// the BF16 bytes); WF_FP8: its codes [BN, BK] (half) and the block scale of each row, [BN] fp32
// (a k tile lies in one 128-k block). Either way each lane decodes its own fragments from them
// (the header).
template <class C, int WF> struct moe_b_layout {
    static constexpr bool WQ = WF != WF_BF16;
    static constexpr int QROW = WF == WF_FP8 ? C::BK : C::BK / 2; // code bytes a B row per k tile
    // scale bytes a row per k tile
    static constexpr int SROW = WF == WF_NVFP4 ? C::BK / 16 : WF == WF_FP8 ? 4 : 0;
    static constexpr int QC = QROW / 16;                           // 16-byte code chunks a row
    static constexpr int QSTAGE = C::BN * (QROW + SROW);
    static constexpr size_t A_STAGE = (size_t)C::A_PARTS * C::BM * C::BK * 2;
    // WQ: C::QSTAGES where the shape sets it, else as many stages as the BF16 shape's shared
    // memory holds, up to twice its count: a stage carries about half of the bytes or less, and at
    // decode sizes the bytes in flight set the rate
    static constexpr int STAGES = !WQ          ? C::STAGES
                                  : C::QSTAGES ? C::QSTAGES
                                               : (int)(C::smem / (A_STAGE + QSTAGE) < 2 * C::STAGES
                                                           ? C::smem / (A_STAGE + QSTAGE)
                                                           : 2 * C::STAGES);
    // the B stages
    static constexpr size_t bytes =
        WQ ? (size_t)STAGES * QSTAGE : (size_t)STAGES * C::BN * C::BK * 2;
    // the whole dynamic shared memory of the grouped kernels (the tiny GEMM 1 has its own)
    static constexpr size_t smem = (size_t)STAGES * A_STAGE + bytes;
};

// A_FULL's layout of x's rows in shared memory (at sAf: [A_PARTS][nk][R1 rows][BK], swizzled):
// chunk c (8 values, p then q) of tile row r in BF16 (high: the hi parts, then the lo parts).
template <class C>
__device__ __forceinline__ void a_full_store8(uint32_t sAf, int r, int c, int nk, int R1,
                                              const float4 &p, const float4 &q) {
    constexpr int BK = C::BK;
    uint4 v, lo = make_uint4(0, 0, 0, 0);
    if (C::SPLIT)
        split_bf16x8(p, q, &v, &lo);
    else
        v = pack_bf16x8(p, q);
    const int kt = c / (BK / 8), ch = c % (BK / 8);
#pragma unroll
    for (int part = 0; part < C::A_PARTS; part++) {
        const uint32_t dst = sAf + ((part * nk + kt) * R1 * BK + swz<BK>(r, ch)) * 2;
        const uint4 w4 = part ? lo : v;
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(w4.x), "r"(w4.y),
                     "r"(w4.z), "r"(w4.w));
    }
}

// linear_bi's ranges in one cluster (moe_gemm_args.cluster): each block puts its sums [rows, BN]
// in its shared memory at sp, and after the cluster's barrier block `split` adds a share of the
// tile's elements over the S blocks in split order, s = 0 first: bi_reduce_kernel's adds, the
// same bits. The second barrier keeps every block's shared memory until the others have read it.
template <class C>
__device__ __forceinline__ void
bi_cluster_epilogue(const moe_gemm_args &a, const float (&acc)[C::MI][C::NI][4], uint32_t sp,
                    int rows, int nb, int split, int S) {
    constexpr int BN = C::BN;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / C::WARPS_N, wn = warp % C::WARPS_N;
    float *tile = reinterpret_cast<float *>(__cvta_shared_to_generic(sp));
#pragma unroll
    for (int mi = 0; mi < C::MI; mi++)
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int r = wm * C::WM + mi * 16 + (lane >> 2) + hr * 8;
            if (r >= rows) continue;
#pragma unroll
            for (int ni = 0; ni < C::NI; ni++) {
                const int c = wn * C::WN + ni * 8 + 2 * (lane & 3);
                *reinterpret_cast<float2 *>(tile + r * BN + c) =
                    make_float2(acc[mi][ni][2 * hr], acc[mi][ni][2 * hr + 1]);
            }
        }
    cg::cluster_group cl = cg::this_cluster();
    cl.sync();
    const int n4 = rows * BN / 4; // BN % 4 == 0 and N % 8 == 0: a float4 never crosses N
    for (int i = split * C::threads + tid; i < n4; i += S * C::threads) {
        const int r = i * 4 / BN, col = nb * BN + i * 4 % BN;
        if (col >= a.N) continue;
        float4 v = *reinterpret_cast<const float4 *>(cl.map_shared_rank(tile, 0) + i * 4);
        for (int s = 1; s < S; s++) {
            const float4 p = *reinterpret_cast<const float4 *>(cl.map_shared_rank(tile, s) + i * 4);
            v.x = __fadd_rn(v.x, p.x);
            v.y = __fadd_rn(v.y, p.y);
            v.z = __fadd_rn(v.z, p.z);
            v.w = __fadd_rn(v.w, p.w);
        }
        *reinterpret_cast<float4 *>(a.out + (int64_t)r * a.N + col) = v;
    }
    cl.sync();
}

// One (tile, N-block) of a grouped GEMM: C[rows, cols] = A[rows, Kd] W_e[cols, Kd]^T.
// Block b of the 1-D grid is N-block b % n_col_blocks of tile b / n_col_blocks: the blocks that
// run together share their A rows (and an expert's tiles follow each other), so A is read from
// L2 and the weights from memory about once.
// GATE_UP: the block's BN weight rows are, per warp, WN/2 gate rows then the WN/2 up rows of the
// same h columns, so a thread holds g and u of the same (row, column) and writes silu(g) * u.
// Launched with PDL: GEMM 1 waits for the kernel before it (the prepare kernel, or in TINY the one
// that wrote x and topk_ids) before anything; GEMM 2 starts during GEMM 1's tail, reads its tile
// (written by the prepare kernel, or in TINY topk_ids: complete before any GEMM 1 block let it
// start) and prefetches its first weight stages, then waits for h.
// TINY: no prepare kernel; the block groups topk_ids itself (tiny_group), h rows are pair ids, and
// GEMM 1 holds its rows of x for the whole of Kd in shared memory (A_FULL), converted from fp32
// once at the start (the prepare kernel's conversion, bit for bit) while its first weight stages
// are in flight.
// BI (linear_bi at a few rows, GEMM 2's form, not TINY): no prepare kernel; the block's rows are
// x's n_pairs rows in order (one tile, expert 0), converted from fp32 for the block's k range into
// shared memory as A_FULL does, after its first weight stages are requested and the kernel before
// has completed. With moe_gemm_args.cluster the ranges are added in the cluster (above).
template <class C, bool GATE_UP, bool TINY, bool BI = false, int WF = WF_BF16>
__global__ void __launch_bounds__(C::threads) moe_gemm_kernel(moe_gemm_args a) {
    typedef moe_b_layout<C, WF> BL;
    constexpr int BM = C::BM, BN = C::BN, BK = C::BK, STAGES = BL::STAGES, MI = C::MI, NI = C::NI;
    // W4: NVFP4 codes and group scales in the stages; W8: FP8 codes, block scales on the sums
    constexpr bool W4 = WF == WF_NVFP4, W8 = WF == WF_FP8, WQ = W4 || W8;
    constexpr int KPB = W4 ? 2 : 1; // k a code byte
    static_assert(!W4 || !BI, "linear_bi's weights are BF16 or FP8");
    static_assert(!WQ || BK % 64 == 0, "WQ: whole 64-k chunks of codes a k tile");
    static_assert(!BI || (!GATE_UP && !TINY), "BI is GEMM 2's form");
    constexpr bool A_FULL = (TINY && GATE_UP) || BI;
    if (GATE_UP) {
        pdl_wait();
        pdl_trigger();
    } else if (a.wait_first) {
        pdl_wait();
    } else if (BI && !a.cluster) {
        pdl_trigger(); // the reduction of the ranges may take its place; it waits for this grid
    }
    // block b: tile b / (n_col_blocks S), then split, then N-block (S = 1 but in linear_bi); in a
    // cluster launch the split varies fastest
    const int S = GATE_UP || TINY ? 1 : max(1, a.n_splits);
    const bool in_cluster = BI && a.cluster;
    const int tile = blockIdx.x / (a.n_col_blocks * S);
    const int split = S == 1 ? 0 : in_cluster ? blockIdx.x % S : blockIdx.x / a.n_col_blocks % S;
    const int nb = in_cluster ? blockIdx.x / S % a.n_col_blocks : blockIdx.x % a.n_col_blocks;
    // the k tiles of this block: [kt0, kt0 + nk) of Kd's (all of them but in linear_bi)
    const int nk_all = (a.Kd + C::BK - 1) / C::BK;
    const int kt0 = S > 1 ? split * a.nk_split : 0;
    const int nk = S > 1 ? max(0, min(nk_all, kt0 + a.nk_split) - kt0) : nk_all;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    __shared__ int s_tile[2], s_pair[TINY ? 16 : 1], s_tok[TINY ? 16 : 1];
    int e, row0 = 0, rows;
    if constexpr (TINY) {
        if (warp == 0) {
            const int np =
                a.n_rows ? min(a.n_pairs, max(0, __ldcg(a.n_rows)) * a.topk) : a.n_pairs;
            tiny_group(a.topk_ids, np, a.E, a.tile_rows, a.topk, tile, s_tile, s_pair, s_tok);
        }
        __syncthreads();
        e = s_tile[0];
        rows = s_tile[1];
        if (e < 0) return; // idle block of the upper-bound grid
    } else if constexpr (BI) {
        e = 0;
        rows = a.n_pairs;
    } else {
        if (tile >= __ldcg(a.n_tiles)) return; // idle block of the upper-bound grid
        const int4 ti = __ldcg(&a.tiles[tile]);
        e = ti.x;
        row0 = ti.y;
        rows = ti.z - ti.y;
    }
    // pair id of tile row r; row of h (GEMM 1's output, GEMM 2's input) of tile row r
    auto pair_of = [&](int r) -> int {
        if constexpr (TINY)
            return s_pair[r];
        else if constexpr (BI)
            return r;
        else
            return __ldcg(&a.pairs[row0 + r]);
    };
    auto h_row = [&](int r) -> int {
        if constexpr (TINY)
            return s_pair[r];
        else
            return row0 + r;
    };
    const int wm = warp / C::WARPS_N, wn = warp % C::WARPS_N;
    // m16 row tiles of this warp that hold rows (warp-uniform): the rest are skipped
    const int mi_busy = min(MI, max(0, (rows - wm * C::WM + 15) / 16));

    constexpr int AP = C::A_PARTS;
    extern __shared__ __align__(128) unsigned char moe_smem[];
    // Without A_FULL: [STAGES, AP, BM, BK] activation stages, then [STAGES, BN, BK] weight stages.
    // A_FULL: the weight stages, then x's rows [AP, nk, R, BK] (R = tile_rows).
    const uint32_t smem0 = (uint32_t)__cvta_generic_to_shared(moe_smem);
    const uint32_t sA = smem0;
    const uint32_t sB = A_FULL ? smem0 : sA + STAGES * AP * BM * BK * 2;
    const uint32_t sAf = smem0 + (uint32_t)BL::bytes;

    // PRIV (the tiny path; the header): each warp copies the B rows it reads (its WN rows'
    // weights, codes and scales), so that a k tile waits for the warp's own copies alone, not for
    // the block's barrier. GEMM 1's x rows are written once before the loop; GEMM 2's tile of up
    // to PR rows (priv_a) is copied by each warp into its own PR rows of the activation stage
    // (rows past the tile read as row 0; more rows: the block's copies and barrier).
    constexpr bool PRIV = TINY && C::WARPS_M == 1;
    constexpr int PR = BM / C::WARPS_N;
    const bool priv_a = PRIV && (GATE_UP || rows <= PR);
    static_assert(!PRIV || C::WN <= 32, "PRIV: a lane a row's scale");
    static_assert(!PRIV || C::B_ITERS * 32 == C::WN * C::CPR, "PRIV: a warp's rows in B_ITERS");
    static_assert(!PRIV || (32 % C::CPR == 0 && C::A_ITERS * 32 == PR * C::CPR),
                  "PRIV: a warp's activation rows in A_ITERS, one chunk column a lane");
    // This thread's activation load slots: chunk column kc of stage rows a_r[i] (r_first + i
    // ROWS_PER_PASS, or with priv_a the warp's PR rows), each from its tile row's row of act
    // (a_src; NULL past the tile's rows: zeros)
    const int kc = tid % C::CPR, r_first = tid / C::CPR;
    const bf16 *a_src[C::A_ITERS];
    int a_r[C::A_ITERS];
#pragma unroll
    for (int i = 0; i < C::A_ITERS; i++) {
        const int pr = (i * 32 + lane) / C::CPR; // priv_a: the warp's row pr
        const int r = priv_a ? pr : r_first + i * C::ROWS_PER_PASS;
        a_r[i] = priv_a ? wn * PR + pr : r;
        a_src[i] = nullptr;
        if (!A_FULL && r < rows) {
            const int64_t src_row = GATE_UP ? pair_of(r) / a.topk : h_row(r);
            a_src[i] = a.act + src_row * a.Kd;
        }
    }
    const int64_t w_rows = GATE_UP ? 2 * (int64_t)a.N : a.N;
    const bf16 *w_e = a.w + (int64_t)e * w_rows * a.Kd;
    const uint8_t *wq_e = WQ ? a.wq + (int64_t)e * w_rows * (a.Kd / KPB) : nullptr;
    const uint8_t *wsf_e = W4 ? a.wsf + (int64_t)e * w_rows * (a.Kd / 16) : nullptr;
    // Weight row of B tile row r, or -1 past the last column.
    auto b_row = [&](int r) -> int {
        int col, wrow;
        if (GATE_UP) {
            constexpr int HALF = C::WN / 2;
            const int j = r % C::WN;
            col = nb * (BN / 2) + (r / C::WN) * HALF + j % HALF;
            wrow = (j < HALF ? 0 : a.N) + col;
        } else {
            col = nb * BN + r;
            wrow = col;
        }
        return col < a.N ? wrow : -1;
    };

    // LEAN and SEL: load_b's comment below.
    constexpr bool LEAN = WQ && BM == 16 && C::SPLIT, SEL = LEAN && W8;
    auto load_a = [&](int slot, int kt) {
        if constexpr (!A_FULL) {
            const int k = (kt0 + kt) * BK + kc * 8;
            if (LEAN && (kt0 + kt + 1) * BK <= a.Kd) { // inside Kd: load_b's way (below)
#pragma unroll
                for (int part = 0; part < AP; part++)
#pragma unroll
                    for (int i = 0; i < C::A_ITERS; i++) {
                        cp_async16(sA + ((slot * AP + part) * BM * BK + swz<BK>(a_r[i], kc)) * 2,
                                   (a_src[i] ? a_src[i] : a.act) + part * a.act_lo + k,
                                   a_src[i] ? 16 : 0);
                    }
                return;
            }
            const bool k_ok = k < a.Kd;
#pragma unroll
            for (int part = 0; part < AP; part++)
#pragma unroll
                for (int i = 0; i < C::A_ITERS; i++) {
                    const bool ok = k_ok && a_src[i];
                    cp_async16(sA + ((slot * AP + part) * BM * BK + swz<BK>(a_r[i], kc)) * 2,
                               ok ? a_src[i] + part * a.act_lo + k : a.act, ok ? 16 : 0);
                }
        }
    };
    // WQ: this thread's load slots, fixed for the whole loop: QI 16-byte code chunks (32 k in
    // NVFP4, 16 in FP8) and (NVFP4) SI 4-byte scale pieces (64 k) of a stage; source at the
    // block's first k tile (past the last column NULL, zeros; LEAN's but not SEL's the expert's
    // row 0, below), offset in the stage, k within the tile. Kd % 64 == 0, so each is whole inside
    // Kd or past it. Swizzles, so that the fragment reads of eight rows fall in distinct banks:
    // NVFP4 with 4 chunks a row, rows r with r & 2 swap their halves (wq_frag's 8-byte reads); with
    // 8 (BK 256), row r's pairs of chunks XOR (r & 3) (four rows' 32 bytes in distinct banks); FP8
    // with 8 chunks a row (BK 128), odd rows swap their halves (w8_frag's 16-byte reads, two rows a
    // phase).
    constexpr int QI = (BN * BL::QC + C::threads - 1) / C::threads;
    constexpr int SI = (BN * (BK / 64) + C::threads - 1) / C::threads;
    const uint8_t *wq_src[WQ ? QI : 1], *ws_src[W4 ? SI : 1];
    int wq_off[WQ ? QI : 1], wq_k[WQ ? QI : 1], ws_off[W4 ? SI : 1], ws_k[W4 ? SI : 1];
    auto q_swz = [&](int r, int c) -> int {
        if constexpr (W4)
            return BL::QC == 4 ? c ^ (r & 2) : BL::QC == 8 ? c ^ ((r & 3) << 1) : c;
        else
            return BL::QC == 8 ? c ^ ((r & 1) << 2) : c;
    };
    if constexpr (WQ) {
        constexpr int QC = BL::QC;
        static_assert(!PRIV || QI * 32 >= C::WN * QC, "PRIV: a warp's rows in QI passes");
#pragma unroll
        for (int it = 0; it < QI; it++) {
            const int j = it * 32 + lane; // PRIV: chunk j of the warp's rows
            const int i = PRIV ? (j < C::WN * QC ? wn * C::WN * QC + j : BN * QC)
                               : tid + it * C::threads,
                      r = i / QC, c = i % QC;
            const int wrow = i < BN * QC ? b_row(r) : -1;
            wq_src[it] =
                wrow >= 0 ? wq_e + (int64_t)wrow * (a.Kd / KPB) + kt0 * BK / KPB + c * 16 : nullptr;
            if (LEAN && !SEL && wrow < 0 && i < BN * QC)
                wq_src[it] = wq_e + kt0 * BK / KPB + c * 16;
            wq_off[it] = i < BN * QC ? r * BL::QROW + q_swz(r, c) * 16 : -1;
            wq_k[it] = c * 16 * KPB;
        }
    }
    if constexpr (W4) {
        constexpr int SC = BK / 64;
        static_assert(!PRIV || SI * 32 >= C::WN * SC, "PRIV: a warp's scales in SI passes");
#pragma unroll
        for (int it = 0; it < SI; it++) {
            const int j = it * 32 + lane; // PRIV: scale piece j of the warp's rows
            const int i = PRIV ? (j < C::WN * SC ? wn * C::WN * SC + j : BN * SC)
                               : tid + it * C::threads,
                      r = i / SC, c = i % SC;
            const int wrow = i < BN * SC ? b_row(r) : -1;
            ws_src[it] =
                wrow >= 0 ? wsf_e + (int64_t)wrow * (a.Kd / 16) + kt0 * BK / 16 + c * 4 : nullptr;
            if (LEAN && wrow < 0 && i < BN * SC) ws_src[it] = wsf_e + kt0 * BK / 16 + c * 4;
            ws_off[it] = i < BN * SC ? BN * BL::QROW + r * BL::SROW + c * 4 : -1;
            ws_k[it] = c * 64;
        }
    }
    // W8: this thread's scale rows (r8_off: offset in the stage, -1 for none; r8_src: the row's
    // scale at 128-k block 0, the next block w_rows floats on; past the last column as above)
    constexpr int S8I = W8 ? (BN + C::threads - 1) / C::threads : 1;
    const float *r8_src[S8I], *r8_first = nullptr; // r8_first: SEL's
    int r8_off[S8I];
    if constexpr (W8) {
        const int64_t nkb = (a.Kd + QUANT_FP8_BLOCK - 1) / QUANT_FP8_BLOCK;
        const float *s_e = reinterpret_cast<const float *>(a.wsf) + (int64_t)e * nkb * w_rows;
        r8_first = s_e;
#pragma unroll
        for (int it = 0; it < S8I; it++) {
            const int r =
                PRIV ? (it == 0 && lane < C::WN ? wn * C::WN + lane : BN) : tid + it * C::threads;
            const int wrow = r < BN ? b_row(r) : -1;
            r8_src[it] = wrow >= 0 ? s_e + wrow : nullptr;
            if (LEAN && !SEL && wrow < 0 && r < BN) r8_src[it] = s_e;
            r8_off[it] = r < BN ? BN * BL::QROW + r * 4 : -1;
        }
    }
    // LEAN (the quantized formats' tiles of 16 rows in high precision, whose issue rate bounds
    // them): where a k tile lies inside Kd (every one but a short last tile), the copies go
    // without a guard each: a slot past the last column takes the expert's row 0 (set up above;
    // its sums land in columns the epilogue skips), so each copy is an address and the
    // instruction. H200: 3 to 5% faster in high. In medium as fast or slower: with a zero-byte
    // copy for those slots, FP8 at T = 1 on DeepSeek-V3's experts 6% slower; with row 0
    // (2026-12-05, 3 rounds in a chain) DeepSeek-V3's FP8 -4% and NVFP4 -2% at T = 8, but FP8
    // +2% at T = 1 and Qwen3-30B-A3B's NVFP4 +1% at T = 1 (its batch-1 step +1.7%, one round).
    // In the larger tiles the extra path spilled.
    //
    // SEL (FP8 in high): those slots copy 0 bytes from the expert's row 0 instead (an address and
    // a size selected each copy). Not for its instructions (a few more) but for ptxas: in this
    // form the tiny GEMM 2 gets 118 to 123 registers, in the row-0 form 96 to 102, and with
    // those it was 9% slower (DeepSeek-V3's experts at T = 1, in a chain: 113.3 against 123.9
    // us, T = 2 235.6 against 243.1; the same SASS as at 1f6c61a, scripts/sass_compare.py).
    auto or_first = [](const auto *p, const auto *first) { return p ? p : first; };
    auto load_b = [&](int slot, int kt) {
        if constexpr (WQ) {
            const int kb = (kt0 + kt) * BK;
            const uint32_t q0 = sB + slot * BL::QSTAGE;
            if (LEAN && kb + BK <= a.Kd) {
#pragma unroll
                for (int it = 0; it < QI; it++)
                    if (wq_off[it] >= 0) {
                        if constexpr (SEL)
                            cp_async16(
                                q0 + wq_off[it],
                                or_first(wq_src[it], wq_e + kt0 * BK / KPB + wq_k[it] / KPB) +
                                    kt * (BK / KPB),
                                wq_src[it] ? 16 : 0);
                        else
                            cp_async16(q0 + wq_off[it], wq_src[it] + kt * (BK / KPB), 16);
                    }
#pragma unroll
                for (int it = 0; it < (W4 ? SI : 0); it++)
                    if (ws_off[it] >= 0) cp_async4(q0 + ws_off[it], ws_src[it] + kt * (BK / 16), 4);
#pragma unroll
                for (int it = 0; it < (W8 ? S8I : 0); it++)
                    if (r8_off[it] >= 0)
                        cp_async4(q0 + r8_off[it],
                                  (SEL ? or_first(r8_src[it], r8_first) : r8_src[it]) +
                                      (int64_t)(kb / QUANT_FP8_BLOCK) * w_rows,
                                  !SEL || r8_src[it] ? 4 : 0);
                return;
            }
#pragma unroll
            for (int it = 0; it < QI; it++) {
                if (wq_off[it] < 0) continue;
                const bool ok = wq_src[it] && kb + wq_k[it] < a.Kd;
                cp_async16(q0 + wq_off[it], ok ? wq_src[it] + kt * (BK / KPB) : a.wq, ok ? 16 : 0);
            }
#pragma unroll
            for (int it = 0; it < (W4 ? SI : 0); it++) {
                if (ws_off[it] < 0) continue;
                const bool ok = ws_src[it] && kb + ws_k[it] < a.Kd;
                cp_async4(q0 + ws_off[it], ok ? ws_src[it] + kt * (BK / 16) : a.wsf, ok ? 4 : 0);
            }
#pragma unroll
            for (int it = 0; it < (W8 ? S8I : 0); it++) {
                if (r8_off[it] < 0) continue;
                const bool ok = r8_src[it] && kb < a.Kd;
                cp_async4(q0 + r8_off[it],
                          ok ? r8_src[it] + (int64_t)(kb / QUANT_FP8_BLOCK) * w_rows
                             : reinterpret_cast<const float *>(a.wsf),
                          ok ? 4 : 0);
            }
        } else {
#pragma unroll
            for (int i = 0; i < C::B_ITERS; i++) {
                const int j = i * 32 + lane; // PRIV: chunk j of the warp's rows
                const int r = PRIV ? wn * C::WN + j / C::CPR : r_first + i * C::ROWS_PER_PASS;
                const int c = PRIV ? j % C::CPR : kc, k = (kt0 + kt) * BK + c * 8;
                const int wrow = b_row(r);
                const bool ok = k < a.Kd && wrow >= 0;
                cp_async16(sB + (slot * BN * BK + swz<BK>(r, c)) * 2,
                           ok ? w_e + (int64_t)wrow * a.Kd + k : a.w, ok ? 16 : 0);
            }
        }
    };

    // W8: acc holds the sums of the current 128 k, tot the scaled sums of the earlier ones. ONE:
    // the lo products into acc too (BF16 and W4: tot unused, W4's group scales being in its
    // decoded weights and its tensor scale on the sums; W8: acc from zero each 128-k block, as
    // the W8A16 wgmma kernel's).
    float acc[MI][NI][4], tot[MI][NI][4];
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int ni = 0; ni < NI; ni++)
#pragma unroll
            for (int q = 0; q < 4; q++)
                acc[mi][ni][q] = tot[mi][ni][q] = 0.0f;
    // Prologue: STAGES - 1 k tiles in flight. GEMM 2 issues its weights before waiting for h
    // (one more commit group: [B 0..S-2], [A 0], ..., [A S-2]); either way k tile kt is complete
    // once all but the newest STAGES - 2 groups are.
    if (!GATE_UP) {
#pragma unroll
        for (int s = 0; s < STAGES - 1; s++)
            if (s < nk) load_b(s, s);
        cp_async_commit();
        pdl_wait();
    }
    // A_FULL: x's rows of this tile for the block's k tiles (all of Kd but in BI), in BF16 (high:
    // hi then lo), zero past Kd, loaded in batches of CB 16-byte chunks a thread (all of a batch's
    // loads issued before any is used) and converted into shared memory while the weight stages
    // are in flight. The main loop's first barrier publishes them.
    // A thread's chunks are i = i0 + j threads + tid, j < CB a batch, chunk c = i % cpr of row
    // r = i / cpr: walked from (tid / cpr, tid % cpr) in steps of threads, without a division a
    // chunk (cpr is known only here; the divisions were most of the instructions before the first
    // weight copy, about 25 each).
    const int R1 = a.tile_rows;
    const int cpr = nk * (BK / 8); // 16-byte chunks per row
    constexpr int CB = C::threads >= 128 ? 8 : 4;
    struct x_chunk {
        int r, c;
    };
    const int cpr_d = max(cpr, 1); // linear_bi's blocks past the ranges have no k tiles
    const x_chunk x_step = {(int)(C::threads / (unsigned)cpr_d),
                            (int)(C::threads % (unsigned)cpr_d)};
    auto x_next = [&](x_chunk &w) {
        w.r += x_step.r;
        w.c += x_step.c;
        if (w.c >= cpr) w.c -= cpr, w.r++;
    };
    auto x_load = [&](x_chunk w, float4(&p)[CB], float4(&q)[CB]) {
#pragma unroll
        for (int j = 0; j < CB; j++, x_next(w)) {
            const int k = kt0 * BK + w.c * 8;
            p[j] = q[j] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (w.r < rows && k < a.Kd) {
                const int xr = BI ? w.r : s_tok[w.r];
                const float4 *src = reinterpret_cast<const float4 *>(a.x + (int64_t)xr * a.Kd + k);
                p[j] = __ldcg(src);
                q[j] = __ldcg(src + 1);
            }
        }
    };
    // stores a batch's chunks and moves w past them (the next batch's first)
    auto x_store = [&](x_chunk &w, const float4(&p)[CB], const float4(&q)[CB]) {
#pragma unroll
        for (int j = 0; j < CB; j++, x_next(w))
            if (w.r < rows) a_full_store8<C>(sAf, w.r, w.c, nk, R1, p[j], q[j]);
    };
    // NVFP4's TINY GEMM 1, and FP8's in medium, with the tile's x rows in one batch (up to
    // threads x CB chunks: one row of D up to 8192, two of 2048): the batch requested before the
    // weights. Requested after them, it queued behind them (H200, Qwen3-30B-A3B's FP8 experts in
    // medium at T = 1: x's conversion put 1.6 us on a call in a chain). BF16, and FP8 in high,
    // gained nothing alone and lost 1 to 2% in batch-1 steps this way (the header).
    constexpr bool X_FIRST = TINY && GATE_UP && (W4 || (W8 && !C::SPLIT));
    const bool x_first = X_FIRST && rows * cpr <= C::threads * CB;
    float4 xf_p[X_FIRST ? CB : 1], xf_q[X_FIRST ? CB : 1];
    x_chunk x_w = {cpr > 0 ? (int)((unsigned)tid / cpr_d) : rows, // no k tiles: no chunks
                   (int)((unsigned)tid % cpr_d)};
    if constexpr (X_FIRST)
        if (x_first) x_load(x_w, xf_p, xf_q);
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < nk) {
            load_a(s, s);
            if (GATE_UP) load_b(s, s);
        }
        cp_async_commit();
    }
    if constexpr (A_FULL) {
        if constexpr (X_FIRST)
            if (x_first) x_store(x_w, xf_p, xf_q);
        for (int i0 = x_first ? rows * cpr : 0; i0 < rows * cpr; i0 += C::threads * CB) {
            float4 p[CB], q[CB];
            x_load(x_w, p, q);
            x_store(x_w, p, q);
        }
    }
    // mbc: std::integral_constant with the busy m16 row tiles (BUSY_STATIC), else -1 (mi_busy)
    auto main_loop = [&](auto mbc) {
        constexpr int MB_STATIC = decltype(mbc)::value;
        // WQ with one m16 tile a warp: every block has a row, so the tile is busy; known at
        // compile time, the k16 steps are one straight run of code for the scheduler
        constexpr bool ONE_M = WQ && MI == 1 && C::WARPS_M == 1;
        const int mb = MB_STATIC >= 0 ? MB_STATIC : ONE_M ? 1 : mi_busy;
        // in high the tiles of 128 rows spilled with volatile products already: kept as timed
        // (WQ's products are not volatile in either precision: no spill, the same times)
        constexpr bool NV = (C::BUSY_STATIC && !C::SPLIT) || WQ;
        if constexpr (PRIV && A_FULL) __syncthreads(); // x's rows, once
        for (int kt = 0; kt < nk; kt++) {
            cp_async_wait<STAGES - 2>(); // k tile kt has landed (for this thread) ...
            if (priv_a)
                __syncwarp(); // ... for the warp, whose rows alone it reads
            else
                __syncthreads(); // ... for every thread; slot (kt - 1) % STAGES is free
            const int nxt = kt + STAGES - 1;
            if (nxt < nk) {
                load_a(nxt % STAGES, nxt);
                load_b(nxt % STAGES, nxt);
            }
            cp_async_commit();

            const int slot = kt % STAGES;
            // W8: does this k tile end a 128-k block (or Kd)? Then the scales of this lane's two
            // columns (weight rows) of each n8 tile, from the stage (zeros past the last column),
            // used after the tile's products.
            const int k_end = (kt0 + kt + 1) * BK;
            const bool w8_end = W8 && (k_end % QUANT_FP8_BLOCK == 0 || kt + 1 == nk);
            float2 w8_sc[W8 ? NI : 1];
            (void)w8_end;
            (void)w8_sc;
            if constexpr (W8) {
                if (w8_end) {
                    const uint32_t sc0 = sB + slot * BL::QSTAGE + BN * BL::QROW;
#pragma unroll
                    for (int ni = 0; ni < NI; ni++)
                        asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n"
                                     : "=f"(w8_sc[ni].x), "=f"(w8_sc[ni].y)
                                     : "r"(sc0 + (wn * C::WN + ni * 8 + 2 * (lane & 3)) * 4));
                }
            }
            const uint32_t a_base = sA + slot * AP * BM * BK * 2;
            const uint32_t b_base = sB + slot * BN * BK * 2; // (not WQ)
            (void)b_base;
            // WQ: the B fragment of n8 tile ni at k16 step kk, decoded from stage `slot`
            // (nvfp4_pack_kernel's layout). At each 64-k chunk (kk % 4 == 0, called in order of
            // kk) the lane loads its 8 code bytes and its row's 4 group scales of the chunk.
            uint32_t wq_q[W4 ? NI : 1][2], wq_s[W4 ? NI : 1];
            auto wq_frag = [&](uint32_t(&b)[2], int ni, int kk) {
                if ((kk & 3) == 0) {
                    const uint32_t q0 = sB + slot * BL::QSTAGE, s0 = q0 + BN * BL::QROW;
                    const int r = wn * C::WN + ni * 8 + (lane >> 2), t = lane & 3;
                    const int ch = (kk >> 2) * 2 + (t >> 1);
                    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n"
                                 : "=r"(wq_q[ni][0]), "=r"(wq_q[ni][1])
                                 : "r"(q0 + r * BL::QROW + q_swz(r, ch) * 16 + (t & 1) * 8));
                    asm volatile("ld.shared.u32 %0, [%1];\n"
                                 : "=r"(wq_s[ni])
                                 : "r"(s0 + r * BL::SROW + (kk >> 2) * 4));
                }
                const uint32_t q = wq_q[ni][(kk >> 1) & 1];
                const uint32_t sf2 = wq_scale2(wq_s[ni], kk & 3); // group kk's scale
                const int j = (kk & 1) * 2;
                b[0] = bf16x2_mul(wq_decode(q, j), sf2);
                b[1] = bf16x2_mul(wq_decode(q, j + 1), sf2);
            };
            // W8: the same from FP8 codes (fp8_pack_kernel's layout): at each 64-k chunk the lane
            // loads its 16 code bytes, a word per k16 step.
            uint32_t w8_q[W8 ? NI : 1][4];
            auto w8_frag = [&](uint32_t(&b)[2], int ni, int kk) {
                if ((kk & 3) == 0) {
                    const int r = wn * C::WN + ni * 8 + (lane >> 2);
                    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                                 : "=r"(w8_q[ni][0]), "=r"(w8_q[ni][1]), "=r"(w8_q[ni][2]),
                                   "=r"(w8_q[ni][3])
                                 : "r"(sB + slot * BL::QSTAGE + r * BL::QROW +
                                       q_swz(r, (kk >> 2) * 4 + (lane & 3)) * 16));
                }
                const uint32_t q = w8_q[ni][kk & 3];
                constexpr uint32_t p120 = FP8_W8_BF16_2P120 | FP8_W8_BF16_2P120 << 16;
                b[0] = bf16x2_mul(fp8_w8_decode(q, 0), p120);
                b[1] = bf16x2_mul(fp8_w8_decode(q, 1), p120);
            };
            (void)a_base; // unused where x's rows sit in shared memory whole (A_FULL)
            // activation fragment address: part, tile row r, 16-byte chunk ch of this k tile
            auto a_addr = [&](int part, int r, int ch) -> uint32_t {
                if constexpr (A_FULL) {
                    const int rr = r < rows ? r : 0; // rows past the tile: any data, results unused
                    return sAf + ((part * nk + kt) * R1 * BK + swz<BK>(rr, ch)) * 2;
                } else { // priv_a: the warp's rows (past the tile: any data, results unused)
                    const int rr = priv_a ? wn * PR + (r < PR ? r : 0) : r;
                    return a_base + (part * BM * BK + swz<BK>(rr, ch)) * 2;
                }
            };
            // the weight fragments fb[ni] of k16 step kk: decoded (WQ) or by ldmatrix, two n8
            // tiles a load
            auto load_b_frags = [&](uint32_t(&fb)[NI][2], int kk) {
                if constexpr (W8) {
#pragma unroll
                    for (int ni = 0; ni < NI; ni++)
                        w8_frag(fb[ni], ni, kk);
                } else if constexpr (W4) {
#pragma unroll
                    for (int ni = 0; ni < NI; ni++)
                        wq_frag(fb[ni], ni, kk);
                } else {
#pragma unroll
                    for (int p = 0; p < NI / 2; p++) {
                        const int r = wn * C::WN + p * 16 + (lane & 7) + ((lane >> 4) << 3);
                        uint32_t t[4];
                        ldmatrix_x4(t, b_base + swz<BK>(r, kk * 2 + ((lane >> 3) & 1)) * 2);
                        fb[2 * p][0] = t[0];
                        fb[2 * p][1] = t[1];
                        fb[2 * p + 1][0] = t[2];
                        fb[2 * p + 1][1] = t[3];
                    }
                }
            };
            if constexpr (C::PIPE_FRAGS) {
                // High with few tiles per warp (decode): step kk + 1's fragments load while step
                // kk's products run. In the loop below the adds after each step's products hold the
                // next loads back by an mma latency per step; at decode sizes, where a warp has
                // only these few products to issue, that took 1.3x medium's time (1.15x this way,
                // same stages). The fragments of step kk: fa[part][mi] of the activations (hi, lo),
                // fb[ni] of the weights.
                auto load_frags = [&](uint32_t(&fa)[AP][MI][4], uint32_t(&fb)[NI][2], int kk) {
#pragma unroll
                    for (int part = 0; part < AP; part++)
#pragma unroll
                        for (int mi = 0; mi < MI; mi++) {
                            const int r = wm * C::WM + mi * 16 + (lane & 15);
                            if (mi < mb)
                                ldmatrix_x4(fa[part][mi], a_addr(part, r, kk * 2 + (lane >> 4)));
                        }
                    load_b_frags(fb, kk);
                };
                // the loop below's sums: acc = hi w + acc, then acc += lo w (from zero)
                auto mma_step = [&](const uint32_t(&fa)[AP][MI][4], const uint32_t(&fb)[NI][2]) {
                    if constexpr (C::ONE) { // every tile's hi product, then every lo product, so
                                            // that a tile's two do not follow one another
#pragma unroll
                        for (int part = 0; part < 2; part++)
#pragma unroll
                            for (int mi = 0; mi < MI; mi++)
                                if (mi < mb)
#pragma unroll
                                    for (int ni = 0; ni < NI; ni++)
                                        mma_acc<NV>(acc[mi][ni], fa[part][mi], fb[ni]);
                    } else {
#pragma unroll
                        for (int mi = 0; mi < MI; mi++)
                            if (mi < mb)
#pragma unroll
                                for (int ni = 0; ni < NI; ni++) {
                                    float t[4];
                                    mma_zero<NV>(t, fa[1][mi], fb[ni]);
                                    mma_acc<NV>(acc[mi][ni], fa[0][mi], fb[ni]);
#pragma unroll
                                    for (int q = 0; q < 4; q++)
                                        acc[mi][ni][q] = __fadd_rn(acc[mi][ni][q], t[q]);
                                }
                    }
                };
                uint32_t fa[2][AP][MI][4], fb[2][NI][2]; // two buffers: step kk in kk & 1
                load_frags(fa[0], fb[0], 0);
#pragma unroll
                for (int kk = 0; kk < BK / 16; kk++) {
                    if (kk + 1 < BK / 16) load_frags(fa[(kk + 1) & 1], fb[(kk + 1) & 1], kk + 1);
                    mma_step(fa[kk & 1], fb[kk & 1]);
                }
            } else {
#pragma unroll
                for (int kk = 0; kk < BK / 16; kk++) {
                    uint32_t af[MI][4], bfr[NI][2];
                    // the weight fragments, loaded once, meet each activation part in turn: hi
                    // through the tensor cores' accumulator, then lo from zero, added in fp32 (see
                    // the header)
#pragma unroll
                    for (int part = 0; part < AP; part++) {
#pragma unroll
                        for (int mi = 0; mi < MI; mi++) {
                            const int r = wm * C::WM + mi * 16 + (lane & 15);
                            if (mi < mb) ldmatrix_x4(af[mi], a_addr(part, r, kk * 2 + (lane >> 4)));
                        }
                        if (part == 0) load_b_frags(bfr, kk);
#pragma unroll
                        for (int mi = 0; mi < MI; mi++)
                            if (mi < mb)
#pragma unroll
                                for (int ni = 0; ni < NI; ni++) {
                                    if (part == 0) {
                                        mma_acc<NV>(acc[mi][ni], af[mi], bfr[ni]);
                                    } else if constexpr (C::ONE) {
                                        mma_acc<NV>(acc[mi][ni], af[mi], bfr[ni]);
                                    } else {
                                        float t[4];
                                        mma_zero<NV>(t, af[mi], bfr[ni]);
#pragma unroll
                                        for (int q = 0; q < 4; q++)
                                            acc[mi][ni][q] = __fadd_rn(acc[mi][ni][q], t[q]);
                                    }
                                }
                    }
                }
            }
            if constexpr (W8) { // the block's sums into the total, times their rows' scales
                if (w8_end) {
#pragma unroll
                    for (int mi = 0; mi < MI; mi++)
#pragma unroll
                        for (int ni = 0; ni < NI; ni++)
#pragma unroll
                            for (int q = 0; q < 4; q++) {
                                const float sc = (q & 1) ? w8_sc[ni].y : w8_sc[ni].x;
                                tot[mi][ni][q] = __fmaf_rn(sc, acc[mi][ni][q], tot[mi][ni][q]);
                                acc[mi][ni][q] = 0.0f;
                            }
                }
            }
        }
    };
    if constexpr (C::BUSY_STATIC)
        with_static_count<MI>(mi_busy, main_loop);
    else
        main_loop(std::integral_constant<int, -1>{});
    cp_async_wait<0>();

    // Epilogue. Accumulator q of n8 tile ni: row lane / 4 (+ 8 for q >= 2), column
    // 2 * (lane % 4) + (q & 1). W8: the scaled total.
    if constexpr (W8) {
#pragma unroll
        for (int mi = 0; mi < MI; mi++)
#pragma unroll
            for (int ni = 0; ni < NI; ni++)
#pragma unroll
                for (int q = 0; q < 4; q++)
                    acc[mi][ni][q] = tot[mi][ni][q];
    }
    if constexpr (BI) {
        if (in_cluster) { // its sums after x's rows (bi_run_small's shared memory)
            // the kernel after may launch while the ranges are added (at the start instead,
            // its blocks slowed the GEMM's: H200, batch-1 deterministic step 3.81 ms, 3.50 here)
            pdl_trigger();
            bi_cluster_epilogue<C>(a, acc, sAf + (uint32_t)(AP * a.nk_split * R1 * BK * 2), rows,
                                   nb, split, S);
            return;
        }
    }
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int r = wm * C::WM + mi * 16 + (lane >> 2) + hr * 8;
            if (r >= rows) continue;
            if (GATE_UP) {
                bf16 *dst = a.h + (int64_t)h_row(r) * a.N;
#pragma unroll
                for (int ni = 0; ni < NI / 2; ni++) {
                    const int col = nb * (BN / 2) + wn * (C::WN / 2) + ni * 8 + 2 * (lane & 3);
                    if (col >= a.N) continue;
                    float g[2] = {acc[mi][ni][2 * hr], acc[mi][ni][2 * hr + 1]};
                    float u[2] = {acc[mi][ni + NI / 2][2 * hr], acc[mi][ni + NI / 2][2 * hr + 1]};
                    if constexpr (W4) { // the tensor scales of the gate and the up projection
                        const float sg = __ldg(&a.ws2[3 * e]), su = __ldg(&a.ws2[3 * e + 1]);
                        g[0] = __fmul_rn(g[0], sg);
                        g[1] = __fmul_rn(g[1], sg);
                        u[0] = __fmul_rn(u[0], su);
                        u[1] = __fmul_rn(u[1], su);
                    }
                    if (C::SPLIT) {
                        uint32_t hi, lo;
                        split_bf16x2(__fmul_rn(silu(g[0]), u[0]), __fmul_rn(silu(g[1]), u[1]), &hi,
                                     &lo);
                        *reinterpret_cast<uint32_t *>(dst + col) = hi;
                        *reinterpret_cast<uint32_t *>(dst + a.h_lo + col) = lo;
                    } else {
                        *reinterpret_cast<uint32_t *>(dst + col) =
                            pack_bf16x2(silu(g[0]) * u[0], silu(g[1]) * u[1]);
                    }
                }
            } else {
                float *dst = (S > 1 ? a.part + split * a.part_stride : a.out) +
                             (int64_t)pair_of(r) * a.N;
#pragma unroll
                for (int ni = 0; ni < NI; ni++) {
                    const int col = nb * BN + wn * C::WN + ni * 8 + 2 * (lane & 3);
                    if (col >= a.N) continue;
                    float y0 = acc[mi][ni][2 * hr], y1 = acc[mi][ni][2 * hr + 1];
                    if constexpr (W4) { // the down projection's tensor scale
                        const float sd = __ldg(&a.ws2[3 * e + 2]);
                        y0 = __fmul_rn(y0, sd);
                        y1 = __fmul_rn(y1, sd);
                    }
                    *reinterpret_cast<float2 *>(dst + col) = make_float2(y0, y1);
                }
            }
        }
}

// The kernel's dynamic shared memory allowed up to smem at least; returns the amount allowed (the
// largest asked for so far, one device per process). Every launch of a kernel goes through this
// one count: a launch that allowed less after another allowed more would fail the larger one's.
template <class C, bool GATE_UP, bool TINY, bool BI, int WF>
static size_t gemm_allow_smem(size_t smem) {
    static size_t attr_set = 0;
    cuda_smem_allow(moe_gemm_kernel<C, GATE_UP, TINY, BI, WF>, smem, &attr_set);
    return attr_set;
}

// Launches one grouped GEMM with the PDL attribute on the backend's stream; smem: its dynamic
// shared memory (moe_b_layout<C, WF>::smem, or the tiny GEMM 1's, which depends on the shape).
template <class C, bool GATE_UP, bool TINY, bool BI = false, int WF = WF_BF16>
static void launch_gemm(moe_gemm_args a, int max_tiles, size_t smem = moe_b_layout<C, WF>::smem) {
    gemm_allow_smem<C, GATE_UP, TINY, BI, WF>(smem);
    const int64_t blocks = (int64_t)max_tiles * a.n_col_blocks;
    MS_ASSERT(blocks < INT32_MAX);
    cuda_launch_pdl(moe_gemm_kernel<C, GATE_UP, TINY, BI, WF>, dim3((unsigned)blocks),
                    dim3(C::threads), smem, a);
}

// linear_bi's launch with a.cluster set: one tile, each N-block's S ranges one cluster. False
// (nothing launched) when clusters of S blocks of this shared memory cannot run on the device.
template <class C, int WF> static bool launch_bi_cluster(moe_gemm_args a, int S, size_t smem) {
    auto kernel = moe_gemm_kernel<C, false, false, true, WF>;
    static size_t checked = 0;
    static int fits[17]; // by S: 0 unknown, 1 yes, -1 no (at `checked` bytes of shared memory)
    if (S < 2 || S > 16) return false;
    const size_t allowed = gemm_allow_smem<C, false, false, true, WF>(smem);
    if (allowed > checked) {
        CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
        checked = allowed;
        memset(fits, 0, sizeof fits);
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)(a.n_col_blocks * S));
    cfg.blockDim = dim3(C::threads);
    cfg.dynamicSmemBytes = checked; // one answer per S, for the most shared memory asked
    cfg.stream = cuda_stream();
    cudaLaunchAttribute attr[2];
    attr[0] = cuda_cluster_attr((unsigned)S, 1, 1);
    attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[1].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 2;
    if (!fits[S]) {
        int n = 0;
        if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess) n = 0;
        cudaGetLastError(); // not sticky: clear it
        fits[S] = n > 0 ? 1 : -1;
    }
    if (fits[S] < 0) return false;
    cfg.dynamicSmemBytes = smem;
    a.cluster = 1;
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, a));
    return true;
}

// The scratch of moe_experts: device memory grown on demand and kept for the process.
static unsigned char *g_ws;
static size_t g_ws_bytes;

static unsigned char *moe_workspace(size_t bytes) {
    if (bytes <= g_ws_bytes) return g_ws;
    if (g_ws) {
        CUDA_CHECK(cudaStreamSynchronize(cuda_stream())); // queued kernels may still use it
        CUDA_CHECK(cudaFree(g_ws));
    }
    cuda_workspace_changed(); /* graphs that used the old buffer are stale */
    g_ws = nullptr;
    g_ws_bytes = 0;
    const size_t grown = bytes + bytes / 4;
    CUDA_CHECK(cudaMalloc(&g_ws, grown));
    g_ws_bytes = grown;
    return g_ws;
}

static size_t align256(size_t n) { return (n + 255) & ~(size_t)255; }

// Where the prepare kernel's outputs go in the workspace: offsets [E + 1], n_tiles, pairs
// [n_pairs], tiles [max_tiles], xb [AP, T, D] (the hi parts, then in high the lo parts); end: the
// first byte after them, where the caller's own buffers start.
struct moe_prep_layout {
    size_t off, nt, pairs, tiles, xb, end;
};

static moe_prep_layout prep_layout(int E, int64_t n_pairs, int max_tiles, size_t AP, int T,
                                   int D) {
    moe_prep_layout l;
    l.off = 0;
    l.nt = align256(l.off + (size_t)(E + 1) * 4);
    l.pairs = align256(l.nt + 4);
    l.tiles = align256(l.pairs + (size_t)n_pairs * 4);
    l.xb = align256(l.tiles + (size_t)max_tiles * sizeof(int4));
    l.end = align256(l.xb + AP * T * D * 2);
    return l;
}

// Whether x's conversion is a kernel of its own after the count (MOESERVE_PREP_CONVERT_AFTER=1;
// 0: blocks 1.. of the prepare kernel; by default from MOE_PREP_AFTER_BLOCKS blocks of it, T of
// 512 and more at D = 2048. H200, Qwen3-30B-A3B's experts, test_cuda_moe --bf16-timing T, high,
// after against not: T = 64 294.1 against 293.8 us (medium 305.8 against 302.0: the launch),
// 512 369.8 against 370.9, 1024 423.9 / 422.3 against 425.4 / 423.7.)
static int g_convert_after = -1;

// The prepare kernel on l's buffers in ws: x [T, D] into xb (split: and its lo part; x NULL: no
// copy), the pairs of topk_ids [T, K] (NULL: every pair to expert 0) grouped by expert into tiles
// of BM rows.
static moe_prep_args prep_launch(unsigned char *ws, const moe_prep_layout &l, bool split,
                                 const float *x, const int32_t *topk_ids, int T, int K, int D,
                                 int E, int BM, const int32_t *n_rows) {
    const int64_t n_pairs = (int64_t)T * K;
    moe_prep_args p = {};
    p.offsets = (int32_t *)(ws + l.off);
    p.n_tiles = (int32_t *)(ws + l.nt);
    p.pairs = (int32_t *)(ws + l.pairs);
    p.tiles = (int4 *)(ws + l.tiles);
    p.xb = (bf16 *)(ws + l.xb);
    p.xb_lo = split ? p.xb + (int64_t)T * D : nullptr;
    p.x = x;
    p.topk_ids = topk_ids;
    p.n_x8 = x ? (int64_t)T * D / 8 : 0;
    p.n_pairs = (int)n_pairs;
    p.E = E;
    p.BM = BM;
    p.n_rows = n_rows;
    p.K = K;
    // Segments of about 64 pairs (one per warp, at most 32), within the shared memory.
    const int s_fit = (MOE_PREP_SMEM_INTS - 2 * (E + 1)) / prep_row_stride(E);
    MS_ASSERT(s_fit >= 1); // E up to ~4000 local experts
    p.S = (int)std::min<int64_t>({32, (int64_t)s_fit, (n_pairs + 63) / 64});
    const int conv_blocks =
        (int)std::min<int64_t>((p.n_x8 + MOE_PREP_THREADS - 1) / MOE_PREP_THREADS, 264);
    const int after = cuda_env_count("MOESERVE_PREP_CONVERT_AFTER", 2, &g_convert_after);
    p.convert_after =
        conv_blocks > 0 && (after == 2 ? conv_blocks >= MOE_PREP_AFTER_BLOCKS : after == 1);
    const size_t prep_smem = (size_t)(p.S * prep_row_stride(E) + 2 * (E + 1) +
                                      (n_pairs <= MOE_PREP_STAGE ? n_pairs : 0)) *
                             sizeof(int);
    static size_t smem_set = 0;
    cuda_smem_allow(moe_prepare_kernel, prep_smem, &smem_set);
    moe_prepare_kernel<<<p.convert_after ? 1 : 1 + conv_blocks, MOE_PREP_THREADS, prep_smem,
                         cuda_stream()>>>(p);
    CUDA_CHECK_LAUNCH();
    if (p.convert_after)
        cuda_launch_pdl(moe_convert_kernel, dim3(conv_blocks), dim3(MOE_PREP_THREADS), 0, p);
    return p;
}

// The GEMM arguments of w's weights: BF16 copies, or NVFP4 / FP8 codes and scales (w then points
// at the codes too, never read as BF16).
template <int WF> static void set_weights(moe_gemm_args *g, const moe_experts *w, bool gate_up) {
    g->w = (const bf16 *)(gate_up ? w->gate_up : w->down_all);
    if constexpr (WF != WF_BF16) {
        g->wq = (const uint8_t *)(gate_up ? w->gate_up : w->down_all);
        g->wsf = (const uint8_t *)(gate_up ? w->gate_up_sf : w->down_sf);
        g->ws2 = w->s2;
    }
}

template <class C, int WF = WF_BF16>
static void moe_run(float *out, const float *x, const int32_t *topk_ids, const moe_experts *w,
                    int T, int K, int D, int F, const int32_t *n_rows) {
    const int E = w->E, BM = C::BM;
    const int64_t n_pairs = (int64_t)T * K;
    // Tiles: sum over busy experts of ceil(c_e / BM) <= (n + busy * (BM - 1)) / BM, and <= n.
    const int64_t busy = std::min<int64_t>(E, n_pairs);
    const int max_tiles = (int)std::min<int64_t>(n_pairs, (n_pairs + busy * (BM - 1)) / BM);

    // after the prepare kernel's outputs, h [AP, n_pairs, F]: the hi parts, then (high) the lo;
    // then, where GEMM 1 runs on the FP8 tensor cores, x's codes and scales, or where both GEMMs
    // run on wgmma, x's BF16 rows in grouped order
    const size_t AP = C::A_PARTS;
    const moe_prep_layout l = prep_layout(E, n_pairs, max_tiles, AP, T, D);
    const size_t o_h = l.end;
    const bool w8a8 = WF == WF_FP8 && !C::SPLIT && fp8_w8a8_takes(n_pairs, E, D, F);
    const bool wgmma = (WF == WF_BF16 && bf16_wgmma_takes(n_pairs, E, D, F, C::SPLIT)) ||
                       (WF == WF_NVFP4 && bf16_wgmma_w4_takes(n_pairs, E, D, F, C::SPLIT)) ||
                       (WF == WF_FP8 && bf16_wgmma_w8_takes(n_pairs, E, D, F, C::SPLIT));
    const size_t o_q = align256(o_h + AP * n_pairs * F * 2);
    const size_t total = w8a8    ? align256(o_q + fp8_w8a8_scratch_bytes(T, n_pairs, D, F))
                         : wgmma ? align256(o_q + bf16_wgmma_scratch_bytes(n_pairs, D, C::SPLIT))
                                 : o_q;
    unsigned char *ws = moe_workspace(total);
    // (W8A8's GEMMs read x itself and h: no BF16 copy of x)
    const moe_prep_args p = prep_launch(ws, l, C::SPLIT, w8a8 && !wgmma ? nullptr : x, topk_ids, T,
                                        K, D, E, BM, n_rows);
    if (wgmma) { // both GEMMs on wgmma (bf16_gemm.cu), from the same prepared inputs
        if constexpr (WF == WF_NVFP4)
            bf16_wgmma_experts_w4(out, p.xb, T, p.pairs, p.offsets, K, (const uint8_t *)w->gate_up,
                                  (const uint8_t *)w->gate_up_sf, (const uint8_t *)w->down_all,
                                  (const uint8_t *)w->down_sf, w->s2, E, D, F, n_pairs, C::SPLIT,
                                  (bf16 *)(ws + o_h), ws + o_q);
        else if constexpr (WF == WF_FP8)
            bf16_wgmma_experts_w8(out, p.xb, T, p.pairs, p.offsets, K, (const uint8_t *)w->gate_up,
                                  (const float *)w->gate_up_sf, (const uint8_t *)w->down_all,
                                  (const float *)w->down_sf, E, D, F, n_pairs, (bf16 *)(ws + o_h),
                                  ws + o_q);
        else
            bf16_wgmma_experts(out, p.xb, T, p.pairs, p.offsets, K, (const bf16 *)w->gate_up,
                               (const bf16 *)w->down_all, E, D, F, n_pairs, C::SPLIT,
                               (bf16 *)(ws + o_h), ws + o_q);
        return;
    }

    moe_gemm_args g = {};
    g.tiles = p.tiles;
    g.n_tiles = p.n_tiles;
    g.pairs = p.pairs;
    g.topk = K;
    g.out = out;
    g.h = (bf16 *)(ws + o_h);

    g.h_lo = C::SPLIT ? n_pairs * F : 0;
    g.act = p.xb;
    g.act_lo = C::SPLIT ? (int64_t)T * D : 0;
    set_weights<WF>(&g, w, true);
    g.Kd = D;
    g.N = F;
    g.n_col_blocks = (F + C::BN / 2 - 1) / (C::BN / 2);
    if (w8a8)
        fp8_w8a8_gate_up(g.h, x, T, D, F, p.pairs, K, g.wq, (const float *)g.wsf, p.offsets, E,
                         n_pairs, ws + o_q);
    else
        launch_gemm<C, true, false, false, WF>(g, max_tiles);

    g.act = g.h;
    g.act_lo = g.h_lo;
    set_weights<WF>(&g, w, false);
    if (w8a8 && fp8_w8a8_down_takes(n_pairs, E, D, F)) {
        fp8_w8a8_down(out, g.h, T, D, F, p.pairs, g.wq, (const float *)g.wsf, p.offsets, E, n_pairs,
                      ws + o_q);
        return;
    }
    g.Kd = F;
    g.N = D;
    g.n_col_blocks = (D + C::BN - 1) / C::BN;
    launch_gemm<C, false, false, false, WF>(g, max_tiles);
}

// The shapes of the tiny, decode and middle sizes by format (C: the BF16 shape), so that the
// stages hold wider rows of codes (narrow rows stream slower whatever the arithmetic: 64 bytes a
// row at about 63% of the copy rate, 128 at 91%, the header):
// - NVFP4 at BK 128 (the tiny and decode shapes): k tiles of 256 (128 bytes a row), half the
//   stages;
// - the middle shape (BM 64, BK 64) with NVFP4, or FP8 in high: k tiles of 128 (64 and 128 bytes
//   a row; NVFP4 at 256 was slower), two BF16 stages' room. High keeps two stages of codes (41 or
//   49 KB each, so two blocks an SM; three were slower), NVFP4 in medium three (25 KB). FP8 in
//   medium keeps its shape: outside deterministic mode the FP8 x FP8 GEMM takes its sizes from
//   15 pairs an expert, and it was not measured.
template <class C, int WF> struct q_shape {
    static constexpr bool W4_DECODE = WF == WF_NVFP4 && C::BK == 128,
                          MID = C::BM == 64 && C::BK == 64 &&
                                (WF == WF_NVFP4 || (WF == WF_FP8 && C::SPLIT));
    typedef typename std::conditional<
        W4_DECODE, moe_cfg_with<C, 256, C::STAGES / 2 < 2 ? 2 : C::STAGES / 2>,
        typename std::conditional<MID, moe_cfg_with<C, 128, 2, C::SPLIT ? 2 : 3>, C>::type>::type
        type;
};

// The tile shape follows the mean pairs per expert; the result does not depend on it. Limits
// from the H200 (see the header): the middle shape beat the decode one by 10-20% at 16 pairs per
// expert; medium's wide one beat it from 64 (DeepSeek-V3 shape 87% of copy against 72%), lost at
// 32.
// (With n_rows the shape follows the bound T: the result does not depend on it either.)
template <class DECODE, class MID, class MID_WIDE, class PREFILL, int WF = WF_BF16>
static void moe_dispatch(float *out, const float *x, const int32_t *topk_ids, const moe_experts *w,
                         int T, int K, int D, int F, const int32_t *n_rows) {
    const int64_t n_pairs = (int64_t)T * K, E = w->E;
    if (n_pairs <= 12 * E)
        moe_run<typename q_shape<DECODE, WF>::type, WF>(out, x, topk_ids, w, T, K, D, F, n_rows);
    else if (n_pairs <= 48 * E)
        moe_run<typename q_shape<MID, WF>::type, WF>(out, x, topk_ids, w, T, K, D, F, n_rows);
    else if (n_pairs <= 96 * E)
        moe_run<MID_WIDE, WF>(out, x, topk_ids, w, T, K, D, F, n_rows);
    else
        moe_run<PREFILL, WF>(out, x, topk_ids, w, T, K, D, F, n_rows);
}

// ---------------------------------------------------------------------------------------------
// The tiny path (T*K <= MOE_TINY_PAIRS): two launches, no prepare kernel
// ---------------------------------------------------------------------------------------------

#define MOE_TINY_PAIRS   16        /* at most (T = 1, 2 at K = 8); the grouping takes up to 32 */
#define MOE_TINY_A_BYTES (8 << 10) /* GEMM 1's x rows in shared memory, at most (past one row) */

// GEMM 1 reads x itself, so its stages hold only weights: the same four in both precisions.
typedef moe_tile_cfg<16, 64, 128, 1, 4, 4, false> moe_cfg_tiny1;
typedef moe_tile_cfg<16, 64, 128, 1, 4, 4, true> moe_cfg_tiny1_high;
// High BF16 experts of the wgmma kernel's shapes: the same shapes in one chain
typedef moe_tile_cfg<16, 64, 128, 1, 4, 4, true, false, true> moe_cfg_tiny1_one;
typedef moe_tile_cfg<16, 64, 128, 1, 4, 3, true, false, true> moe_cfg_decode_one;
typedef moe_tile_cfg<64, 128, 64, 1, 4, 3, true, true, true> moe_cfg_mid_one;
typedef moe_tile_cfg<128, 256, 64, 2, 4, 3, true, false, true> moe_cfg_prefill_one;

// The blocks of the tiny path's GEMM (C, GATE_UP, WF) resident on the device at once with smem
// bytes of dynamic shared memory (one device a process; the answers for a few sizes kept).
template <class C, bool GATE_UP, int WF> static int64_t tiny_resident(size_t smem) {
    static size_t key[4];
    static int64_t val[4];
    static int n = 0;
    for (int i = 0; i < n; i++)
        if (key[i] == smem) return val[i];
    gemm_allow_smem<C, GATE_UP, true, false, WF>(smem);
    int dev = 0, sms = 0, per_sm = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, moe_gemm_kernel<C, GATE_UP, true, false, WF>, C::threads, smem));
    const int64_t v = (int64_t)per_sm * sms;
    if (n < 4) {
        key[n] = smem;
        val[n++] = v;
    }
    return v;
}

// Whether the tiny path's GEMM takes the shallower shape Cs (shared memory smem_s) instead of C
// (smem): where C's blocks would take two waves and Cs's fit in one.
// - GEMM 2 of BF16 with two stages (the BF16 shapes' three or four): H200, Qwen3-30B-A3B's
//   experts in a chain of calls (tests/test_cuda_moe), medium / high: T = 2 (512 blocks) 39.4 /
//   40.4 us against 40.3 / 43.8 with C2, a batch-2 step 4.21 ms against 4.36; at T = 1 (256
//   blocks, one wave either way) C2's deeper prefetch wins, 23.4 / 25.6 against 24.8 / 26.6.
// - FP8 in medium with four stages of codes instead of six (the BF16 shape's room for three
//   stages, not four), the header's figures: GEMM 1 on DeepSeek-V3's experts at T = 1 (512
//   blocks: three an SM with six stages, four with four), GEMM 2 on Qwen3-30B-A3B's at T = 2
//   (512 blocks). At T = 1 (256 blocks) GEMM 2 with four stages took a batch-1 step 3.11 ms
//   against 3.03 with six, though alone it was faster.
template <class C, class Cs, bool GATE_UP, int WF>
static bool tiny_fewer_stages(int64_t blocks, size_t smem, size_t smem_s) {
    return blocks > tiny_resident<C, GATE_UP, WF>(smem) &&
           blocks <= tiny_resident<Cs, GATE_UP, WF>(smem_s);
}

// The tiny path's GEMM (C, GATE_UP) of FP8 or NVFP4 with one or two stages of codes fewer where
// that fits the grid in one wave and C's stages do not (tiny_fewer_stages, the first that does);
// false, with nothing launched, where neither does. extra: GEMM 1's bytes of x's rows beside the
// stages. H200, in a chain of calls, us (FP8 in medium keeps the rule above, measured first):
// FP8 in high, GEMM 1 on DeepSeek-V3's experts at T = 1 (512 blocks; three stages of codes
// instead of five, four blocks an SM) 124.4 / 124.0 -> 113.3 / 112.8 (69.5% -> 76.4% of the
// copy rate), GEMM 2 on Qwen3-30B-A3B's at T = 2 (512 blocks) 32.5 -> 29.7; NVFP4's GEMM 2 on
// Qwen3's at T = 2, medium / high, 26.8 / 30.9 -> 24.6 / 28.9 (batch-2 steps 3.535 / 3.750 ->
// 3.459 / 3.655 ms); Qwen3's T = 1 unchanged (no grid of it takes two waves).
template <class C, int WF, bool GATE_UP> static size_t tiny_smem(size_t extra) {
    return GATE_UP ? moe_b_layout<C, WF>::bytes + extra : moe_b_layout<C, WF>::smem;
}
template <class C, bool GATE_UP, int WF>
static bool launch_tiny_fewer(const moe_gemm_args &g, int tiles, size_t extra) {
    constexpr int q = moe_b_layout<C, WF>::STAGES;
    if constexpr (q > 2) {
        typedef moe_cfg_with<C, C::BK, C::STAGES, q - 1> Ca;
        typedef moe_cfg_with<C, C::BK, C::STAGES, q - 2 < 2 ? 2 : q - 2> Cb;
        const int64_t blocks = (int64_t)tiles * g.n_col_blocks;
        const size_t s = tiny_smem<C, WF, GATE_UP>(extra), sa = tiny_smem<Ca, WF, GATE_UP>(extra),
                     sb = tiny_smem<Cb, WF, GATE_UP>(extra);
        if (tiny_fewer_stages<C, Ca, GATE_UP, WF>(blocks, s, sa)) {
            launch_gemm<Ca, GATE_UP, true, false, WF>(g, tiles, sa);
            return true;
        }
        if (q > 3 && tiny_fewer_stages<C, Cb, GATE_UP, WF>(blocks, s, sb)) {
            launch_gemm<Cb, GATE_UP, true, false, WF>(g, tiles, sb);
            return true;
        }
    }
    return false;
}

template <class C1_, class C2_, int WF = WF_BF16>
static void moe_run_tiny(float *out, const float *x, const int32_t *topk_ids, const moe_experts *w,
                         int T, int K, int D, int F, const int32_t *n_rows) {
    typedef typename q_shape<C1_, WF>::type C1;
    typedef typename q_shape<C2_, WF>::type C2;
    static_assert(C1::SPLIT == C2::SPLIT, "one precision");
    const int n = T * K, AP = C1::A_PARTS, busy = std::min(w->E, n);
    unsigned char *ws = moe_workspace((size_t)AP * n * F * 2);
    moe_gemm_args g = {};
    g.h = (bf16 *)ws; // [AP, n, F], rows by pair id
    g.h_lo = C1::SPLIT ? (int64_t)n * F : 0;
    g.out = out;
    g.topk = K;
    g.x = x;
    g.topk_ids = topk_ids;
    g.n_pairs = n;
    g.E = w->E;
    g.n_rows = n_rows;

    // GEMM 1: tiles of R1 rows, R1 as small as the batch allows (one row at T = 1) and x's rows
    // within MOE_TINY_A_BYTES, so that three blocks fit on an SM
    const int nk1 = (D + C1::BK - 1) / C1::BK, row_bytes = AP * nk1 * C1::BK * 2;
    const int R1 = std::max(1, std::min({16, MOE_TINY_A_BYTES / row_bytes, T}));
    g.act = g.h; // not read (x is); any valid address
    set_weights<WF>(&g, w, true);
    g.Kd = D;
    g.N = F;
    g.tile_rows = R1;
    g.n_col_blocks = (F + C1::BN / 2 - 1) / (C1::BN / 2);
    const int tiles1 = std::min(n, (n + busy * (R1 - 1)) / R1);
    const size_t smem1 = moe_b_layout<C1, WF>::bytes + (size_t)R1 * row_bytes;
    bool fewer = false;
    if constexpr (WF == WF_FP8 && !C1::SPLIT) {
        typedef moe_cfg_with<C1, C1::BK, C1::STAGES - 1> C1s;
        const size_t smem1s = moe_b_layout<C1s, WF>::bytes + (size_t)R1 * row_bytes;
        fewer =
            tiny_fewer_stages<C1, C1s, true, WF>((int64_t)tiles1 * g.n_col_blocks, smem1, smem1s);
        if (fewer) launch_gemm<C1s, true, true, false, WF>(g, tiles1, smem1s);
    } else if constexpr (WF != WF_BF16) {
        fewer = launch_tiny_fewer<C1, true, WF>(g, tiles1, (size_t)R1 * row_bytes);
    }
    if (!fewer) launch_gemm<C1, true, true, false, WF>(g, tiles1, smem1);

    g.act = g.h;
    g.act_lo = g.h_lo;
    set_weights<WF>(&g, w, false);
    g.Kd = F;
    g.N = D;
    g.tile_rows = C2::BM;
    g.n_col_blocks = (D + C2::BN - 1) / C2::BN;
    const int tiles2 = std::min(n, (n + busy * (C2::BM - 1)) / C2::BM);
    if constexpr (WF == WF_BF16 || (WF == WF_FP8 && !C2::SPLIT)) {
        typedef moe_cfg_with<C2, C2::BK, WF == WF_BF16 ? 2 : C2::STAGES - 1> C2s;
        if (tiny_fewer_stages<C2, C2s, false, WF>((int64_t)tiles2 * g.n_col_blocks,
                                                  moe_b_layout<C2, WF>::smem,
                                                  moe_b_layout<C2s, WF>::smem)) {
            launch_gemm<C2s, false, true, false, WF>(g, tiles2);
            return;
        }
    } else if constexpr (WF != WF_BF16) {
        if (launch_tiny_fewer<C2, false, WF>(g, tiles2, 0)) return;
    }
    launch_gemm<C2, false, true, false, WF>(g, tiles2);
}

// NVFP4 and FP8 experts on the lean kernels (moe_lean.h; MOESERVE_NVFP4_LEAN, MOESERVE_FP8_LEAN):
// the prepare kernel with tiles of `rows` pairs (4, 8, 16, 24 or 32), then both GEMMs with the
// weights as wgmma's A operand; h in the workspace after the prepare kernel's outputs, as moe_run
// has it.
template <int WF>
static void moe_run_lean(float *out, const float *x, const int32_t *topk_ids, const moe_experts *w,
                         int T, int K, int D, int F, const int32_t *n_rows, int rows, bool split) {
    const int E = w->E;
    const int64_t n_pairs = (int64_t)T * K, busy = std::min<int64_t>(E, n_pairs);
    const int max_tiles = (int)std::min<int64_t>(n_pairs, (n_pairs + busy * (rows - 1)) / rows);
    const size_t AP = split ? 2 : 1;
    const moe_prep_layout l = prep_layout(E, n_pairs, max_tiles, AP, T, D);
    unsigned char *ws = moe_workspace(align256(l.end + AP * n_pairs * F * 2));
    const moe_prep_args p = prep_launch(ws, l, split, x, topk_ids, T, K, D, E, rows, n_rows);
    bf16 *h = (bf16 *)(ws + l.end);
    const int64_t xb_lo = split ? (int64_t)T * D : 0;
    if constexpr (WF == WF_FP8)
        moe_lean_w8_experts(out, p.xb, xb_lo, p.pairs, p.tiles, p.n_tiles, max_tiles, K,
                            (const uint8_t *)w->gate_up, (const float *)w->gate_up_sf,
                            (const uint8_t *)w->down_all, (const float *)w->down_sf, E, D, F,
                            n_pairs, rows, split, h);
    else
        moe_lean_w4_experts(out, p.xb, xb_lo, p.pairs, p.tiles, p.n_tiles, max_tiles, K,
                            (const uint8_t *)w->gate_up, (const uint8_t *)w->gate_up_sf,
                            (const uint8_t *)w->down_all, (const uint8_t *)w->down_sf, w->s2, E, D,
                            F, n_pairs, rows, split, h);
}

// NVFP4 or FP8 experts at up to moe_lean_tiny_pairs() pairs on the lean kernels with no prepare
// kernel (moe_lean_w4_tiny, moe_lean_w8_tiny; split: high precision); h in the workspace, [2, T K,
// F] by pair id.
template <int WF>
static void moe_run_lean_tiny(float *out, const float *x, const int32_t *topk_ids,
                              const moe_experts *w, int T, int K, int D, int F,
                              const int32_t *n_rows, bool split) {
    const size_t n_pairs = (size_t)T * K;
    bf16 *h = (bf16 *)moe_workspace(align256(2 * n_pairs * F * 2));
    if constexpr (WF == WF_FP8)
        moe_lean_w8_experts_tiny(out, x, topk_ids, n_rows, T, K, (const uint8_t *)w->gate_up,
                                 (const float *)w->gate_up_sf, (const uint8_t *)w->down_all,
                                 (const float *)w->down_sf, w->E, D, F, split, h);
    else
        moe_lean_w4_experts_tiny(out, x, topk_ids, n_rows, T, K, (const uint8_t *)w->gate_up,
                                 (const uint8_t *)w->gate_up_sf, (const uint8_t *)w->down_all,
                                 (const uint8_t *)w->down_sf, w->s2, w->E, D, F, split, h);
}

// Whether high precision's FP8 and NVFP4 experts sum the hi and lo products in one chain
// (moe_tile_cfg's ONE) at every size: in deterministic mode, and outside it unless
// MOESERVE_ONE_CHAIN=0 (the tiles' fp32 add of the lo products, other sums than the W8A16 and
// W4A16 wgmma kernels' at prefill sizes).
static int g_q_one = -1;
static bool q_one_chain() {
    return ops_cuda_deterministic() || cuda_env_on("MOESERVE_ONE_CHAIN", &g_q_one);
}
extern "C" int cuda_moe_q_one_chain(void) { return q_one_chain(); }

// The path and tile shapes by size and precision, the weights BF16, NVFP4 or FP8. FP8 keeps the
// middle shape for larger sizes: its second set of accumulators (the scaled totals) would not fit
// beside the wide and prefill shapes' 128 (W8A16 is its decode path; prefill's is to come).
template <int WF>
static void moe_experts_path(float *out, const float *x, const int32_t *topk_ids,
                             const int32_t *n_rows, const moe_experts *w, int T, int K, int D,
                             int F) {
    const bool medium = ops_cuda_matmul_precision() == MATMUL_PRECISION_MEDIUM;
    if constexpr (WF != WF_BF16) { // decode sizes on the lean kernels where they are switched on
        const bool tiny = (int64_t)T * K <= MOE_TINY_PAIRS;
        if ((int64_t)T * K <= moe_lean_tiny_pairs() && (medium || q_one_chain()) &&
            !ops_cuda_deterministic() &&
            (WF == WF_FP8 ? moe_lean_w8_tiny((int64_t)T * K, w->E, D, F, !medium)
                          : moe_lean_w4_tiny((int64_t)T * K, w->E, D, F, !medium))) {
            moe_run_lean_tiny<WF>(out, x, topk_ids, w, T, K, D, F, n_rows, !medium);
            return;
        }
        const int rows = ops_cuda_deterministic() ? 0
                         : WF == WF_FP8
                             ? moe_lean_w8_rows((int64_t)T * K, w->E, D, F, tiny, !medium)
                             : moe_lean_w4_rows((int64_t)T * K, w->E, D, F, tiny, !medium);
        if (rows && (medium || q_one_chain())) {
            moe_run_lean<WF>(out, x, topk_ids, w, T, K, D, F, n_rows, rows, !medium);
            return;
        }
    }
    // High precision, one chain at every size, the wgmma kernels' way, so that they can take the
    // prefill sizes with the same bits (the choice depends on the mode and the shapes alone, never
    // on T): BF16 weights of a shape the wgmma kernel takes (bf16_wgmma_one_chain), FP8 and NVFP4
    // weights always (q_one_chain). The prefill slot: BF16's sizes there are the wgmma kernel's
    // (moe_run), FP8 keeps the middle shape (below), NVFP4's tiles take the shapes wgmma does not.
    if (!medium && (WF == WF_BF16 ? bf16_wgmma_one_chain(D, F) : q_one_chain())) {
        if ((int64_t)T * K <= MOE_TINY_PAIRS)
            moe_run_tiny<moe_cfg_tiny1_one, moe_cfg_decode_one, WF>(out, x, topk_ids, w, T, K, D, F,
                                                                    n_rows);
        else if constexpr (WF == WF_FP8)
            moe_dispatch<moe_cfg_decode_one, moe_cfg_mid_one, moe_cfg_mid_one, moe_cfg_mid_one, WF>(
                out, x, topk_ids, w, T, K, D, F, n_rows);
        else if constexpr (WF == WF_NVFP4)
            moe_dispatch<moe_cfg_decode_one, moe_cfg_mid_one, moe_cfg_mid_one, moe_cfg_prefill_one,
                         WF>(out, x, topk_ids, w, T, K, D, F, n_rows);
        else
            moe_dispatch<moe_cfg_decode_one, moe_cfg_mid_one, moe_cfg_mid_one, moe_cfg_prefill_high,
                         WF>(out, x, topk_ids, w, T, K, D, F, n_rows);
        return;
    }
    if ((int64_t)T * K <= MOE_TINY_PAIRS) {
        if (medium)
            moe_run_tiny<moe_cfg_tiny1, moe_cfg_decode, WF>(out, x, topk_ids, w, T, K, D, F,
                                                            n_rows);
        else
            moe_run_tiny<moe_cfg_tiny1_high, moe_cfg_decode_high, WF>(out, x, topk_ids, w, T, K,
                                                                      D, F, n_rows);
    } else if constexpr (WF == WF_FP8) {
        if (medium)
            moe_dispatch<moe_cfg_decode, moe_cfg_mid, moe_cfg_mid, moe_cfg_mid, WF>(
                out, x, topk_ids, w, T, K, D, F, n_rows);
        else
            moe_dispatch<moe_cfg_decode_high, moe_cfg_mid_high, moe_cfg_mid_high, moe_cfg_mid_high,
                         WF>(out, x, topk_ids, w, T, K, D, F, n_rows);
    } else if (medium) {
        moe_dispatch<moe_cfg_decode, moe_cfg_mid, moe_cfg_mid_wide, moe_cfg_prefill, WF>(
            out, x, topk_ids, w, T, K, D, F, n_rows);
    } else {
        moe_dispatch<moe_cfg_decode_high, moe_cfg_mid_high, moe_cfg_mid_high,
                     moe_cfg_prefill_high, WF>(out, x, topk_ids, w, T, K, D, F, n_rows);
    }
}

// MOE_W_NVFP4_SM100: the prepare kernel's grouping (its BF16 rows unused), then
// cuda_nvfp4_sm100_experts on the same workspace.
static void moe_run_nvfp4_sm100(float *out, const float *x, const int32_t *topk_ids,
                                const moe_experts *w, int T, int K, int D, int F,
                                const int32_t *n_rows) {
    const int E = w->E;
    const int64_t n_pairs = (int64_t)T * K, busy = std::min<int64_t>(E, n_pairs);
    const int max_tiles = (int)std::min<int64_t>(n_pairs, (n_pairs + busy * 127) / 128);
    const moe_prep_layout l = prep_layout(E, n_pairs, max_tiles, 1, T, D);
    const size_t o_s = l.end;
    unsigned char *ws =
        moe_workspace(align256(o_s + cuda_nvfp4_sm100_experts_scratch(n_pairs, E, D, F)));
    const moe_prep_args p = prep_launch(ws, l, false, x, topk_ids, T, K, D, E, 128, n_rows);
    const float *s2 = w->s2;
    cuda_nvfp4_sm100_experts(out, x, D, F, K, p.pairs, p.offsets, E, n_pairs,
                             (const uint8_t *)w->gate_up, (const uint8_t *)w->gate_up_sf, s2,
                             (const uint8_t *)w->down_all, (const uint8_t *)w->down_sf,
                             s2 + (size_t)E * 2 * F / 128, ws + o_s);
}

// moe_experts and moe_experts_n (n_rows: NULL, or the device count of rows to take, <= T).
static void moe_experts_any(float *out, const float *x, const int32_t *topk_ids,
                            const int32_t *n_rows, const moe_experts *w, int T, int K, int D,
                            int F) {
    if (T <= 0 || K <= 0) return;
    MS_ASSERT(D % 8 == 0 && F % 8 == 0 && w->E > 0);
    if (w->wformat == MOE_W_NVFP4_SM100) {
        MS_ASSERT(w->gate_up && w->down_all && w->gate_up_sf && w->down_sf && w->s2);
        moe_run_nvfp4_sm100(out, x, topk_ids, w, T, K, D, F, n_rows);
    } else if (w->wformat == MOE_W_NVFP4) {
        MS_ASSERT(w->gate_up && w->down_all && w->gate_up_sf && w->down_sf && w->s2);
        MS_ASSERT(D % 64 == 0 && F % 64 == 0);
        moe_experts_path<WF_NVFP4>(out, x, topk_ids, n_rows, w, T, K, D, F);
    } else if (w->wformat == MOE_W_FP8) {
        MS_ASSERT(w->gate_up && w->down_all && w->gate_up_sf && w->down_sf);
        MS_ASSERT(D % 64 == 0 && F % 64 == 0);
        moe_experts_path<WF_FP8>(out, x, topk_ids, n_rows, w, T, K, D, F);
    } else {
        MS_ASSERT(w->gate_up && w->down_all && w->wdtype == DTYPE_BF16); // prepare_experts ran
        moe_experts_path<WF_BF16>(out, x, topk_ids, n_rows, w, T, K, D, F);
    }
}

void cuda_moe_experts(float *out, const float *x, const int32_t *topk_ids, const moe_experts *w,
                      int T, int K, int D, int F) {
    moe_experts_any(out, x, topk_ids, nullptr, w, T, K, D, F);
}

void cuda_moe_experts_n(float *out, const float *x, const int32_t *topk_ids,
                        const int32_t *n_rows, const moe_experts *w, int T, int K, int D, int F) {
    moe_experts_any(out, x, topk_ids, n_rows, w, T, K, D, F);
}

// The experts on x after the input format `payload` (kernels/ops.h's moe_experts_q):
// cuda_moe_input_quant into xq, then the experts on xq. Tried and taken out (2026-12-02): the
// format applied by the tiny GEMM 1 as it converts x, one launch a layer fewer with the same bits;
// as a kernel of its own (a template argument, the other kernels unchanged) it was slower in one
// call on the H200 (bench_step, Qwen3-30B-A3B, high, step ms): FP8 batch 1 / 2 3.450 / 4.397
// against 3.401 and 3.348 / 4.009 and 3.962 apart; NVFP4 3.601 / 4.821 against 3.348 / 4.385
// (NVFP4's token scale needs the row's maximum first: each block of GEMM 1 read x twice).
void cuda_moe_experts_q(float *out, float *xq, const float *x, const int32_t *topk_ids,
                        const moe_experts *w, int T, int K, int D, int F, int payload) {
    if (payload != A2A_PAYLOAD_F32) {
        cuda_moe_input_quant(xq, x, T, D, payload);
        x = xq;
    }
    moe_experts_any(out, x, topk_ids, nullptr, w, T, K, D, F);
}

// ---------------------------------------------------------------------------------------------
// linear_bi: a dense linear whose rows are the same bits at every T
// ---------------------------------------------------------------------------------------------
// out[T, N] = x[T, Kd] w[N, Kd]^T, w BF16 on the device, through the grouped GEMM above with one
// "expert" and top-1: the prepare kernel (topk_ids NULL: every row goes to expert 0, in row order)
// converts x and cuts the rows into tiles, then the kernel runs in GEMM 2's form with w as the
// down projection. Its per-element sums depend on neither T nor the tile shape (the header). A
// few hundred weight rows (Qwen3-30B-A3B's k/v_proj 512, the router 128) would leave most
// multiprocessors idle at decode sizes, so Kd is cut into ranges whose length depends on (N, Kd)
// alone, never on T: each range is summed by blocks of its own into part[s] (split s), and a
// reduction adds the ranges in order, part[0] + part[1] + ...: the same sums and the same adds at
// every T. Deterministic mode's linear (kernels/cuda/linear.cu) takes it by default.
// A few rows (decode; x's rows of a range within BI_SMALL_A_BYTES) go without the prepare kernel:
// the BI form of the GEMM kernel converts its rows of x itself, after requesting its first weight
// stages (they depend on no earlier kernel). There the S ranges of an N-block run as one thread-
// block cluster and add their sums through each other's shared memory in split order, the
// reduction kernel's adds (bi_cluster_epilogue), with no fp32 scratch and no second launch; where
// such clusters cannot run (or MOESERVE_BI_CLUSTER=0) the reduction kernel follows with PDL.
// Prefill sizes (T > 96) of weights the wgmma kernel takes (bf16_gemm.cu; N % 256 in medium,
// N % 256 in high too) run there, range by range: in medium the tiles' sums; in high each range
// in one chain (hi, lo), and the tiles below those sizes too (moe_cfg_decode_one, _mid_one), so
// a weight's rows are the same bits at every T either way.
// H200, Qwen3-30B-A3B dummy weights, a batch-1 decode step in deterministic mode (graphs, high):
// 4.46 ms with the prepare kernel, 3.71 without, 3.50 with the cluster (3.17 to 3.21 with the
// mode off). Tried and dropped: the
// reduction as the GEMM's grid tail (the last block of each N-block to count itself done adds the
// ranges of its columns), 4.08 ms against 3.71 in the same run; and at prefill sizes every range
// in one block (each range's sums added into out at its end, read back by the thread that stored
// them; the same bits, from a full wave of tiles on): prefill 1 / 8 x 2048 in deterministic mode
// 10174 / 10675 tokens/s against 10467 / 10982, each range end stalling its block on the read.

#define BI_SPLIT_UNIT    128 /* a range is a multiple of this many k (the largest BK) */
#define BI_TARGET_BLOCKS 256 /* blocks wanted at decode sizes (the decode tile: BN 64) */
#define BI_SMALL_A_BYTES (32 << 10) /* x's rows in shared memory at most, in bi_run_small */

// k per range for a weight [N, Kd]: about BI_TARGET_BLOCKS blocks at T <= BM of the decode tile.
static int bi_split_len(int N, int Kd) {
    const int units = (Kd + BI_SPLIT_UNIT - 1) / BI_SPLIT_UNIT;
    const int col_blocks = (N + 63) / 64;
    const int want = std::max(1, std::min(units, (BI_TARGET_BLOCKS + col_blocks - 1) / col_blocks));
    return (units + want - 1) / want * BI_SPLIT_UNIT;
}

// out[i] = part[0][i] + part[1][i] + ... + part[S-1][i], in that order; n4 = elements / 4.
// Launched with PDL: resident while the GEMM's blocks run, it waits for their sums. (Letting the
// kernel after it start at once as well, pdl_trigger here, made a deterministic batch-1 decode
// step slower on the H200: 4.01 ms, against 3.71 without it in the run before.)
__global__ void bi_reduce_kernel(float *out, const float *part, int64_t n4, int S,
                                 int64_t stride) {
    pdl_wait();
    const int64_t step = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += step) {
        float4 v = __ldcg(reinterpret_cast<const float4 *>(part) + i);
        for (int s = 1; s < S; s++) {
            const float4 p = __ldcg(reinterpret_cast<const float4 *>(part + s * stride) + i);
            v.x = __fadd_rn(v.x, p.x);
            v.y = __fadd_rn(v.y, p.y);
            v.z = __fadd_rn(v.z, p.z);
            v.w = __fadd_rn(v.w, p.w);
        }
        reinterpret_cast<float4 *>(out)[i] = v;
    }
}

// The ranges' sums part[S][T, N] added in order into out (S > 1).
static void bi_reduce(float *out, const float *part, int T, int N, int S) {
    const int64_t n4 = (int64_t)T * N / 4;
    const int blocks = (int)std::min<int64_t>((n4 + 255) / 256, 4 * 132);
    cuda_launch_pdl(bi_reduce_kernel, dim3(blocks), dim3(256), 0, out, part, n4, S,
                    (int64_t)T * N);
}

// What both ways of linear_bi give the GEMM kernel: w [N, Kd] as the down projection of expert
// 0 of a top-1 grouping, Kd in S ranges of L, the ranges' sums into part [S, T, N].
// FP8 (WF_FP8): w is the codes [N, Kd] in fp8_pack_kernel's layout, wsf the scales a row per
// 128-k block [ceil(Kd / 128), N] (cuda_prepare_linear_fp8's tensor).
template <class C, int WF = WF_BF16>
static moe_gemm_args bi_args(float *out, const void *w, const float *wsf, int T, int N, int Kd,
                             int L, int S, float *part) {
    moe_gemm_args g = {};
    g.topk = 1;
    g.out = out;
    g.w = (const bf16 *)w;
    if constexpr (WF == WF_FP8) {
        g.wq = (const uint8_t *)w;
        g.wsf = (const uint8_t *)wsf;
    }
    g.Kd = Kd;
    g.N = N;
    g.n_col_blocks = (N + C::BN - 1) / C::BN;
    g.n_splits = S;
    g.nk_split = L / C::BK;
    g.part = part;
    g.part_stride = (int64_t)T * N;
    return g;
}

// MOESERVE_BI_CLUSTER=0: the ranges of a few rows added by bi_reduce_kernel, not in a cluster.
static int g_bi_cluster = -1;
static bool bi_cluster() { return cuda_env_on("MOESERVE_BI_CLUSTER", &g_bi_cluster); }

// For tests/test_cuda_ops.c (which declares it): the ranges of a few rows added in a cluster (1)
// or by the reduction kernel (0) from now on; returns the way before.
extern "C" int cuda_linear_bi_cluster(int on) {
    const int old = bi_cluster();
    g_bi_cluster = on;
    return old;
}

// A few rows (T <= the tile's BM): one launch of the BI kernel, no prepare kernel, then the
// reduction. The same tiles' arithmetic as bi_run's with the same C: the same bits.
template <class C, int WF>
static void bi_run_small(float *out, const float *x, const void *w, const float *wsf, int T, int N,
                         int Kd, int L) {
    static_assert(BI_SPLIT_UNIT % C::BK == 0, "a range is whole k tiles of every shape");
    MS_ASSERT(T <= C::BM);
    const int S = (Kd + L - 1) / L;
    unsigned char *ws = moe_workspace(S > 1 ? (size_t)S * T * N * 4 : 256);
    moe_gemm_args g = bi_args<C, WF>(out, w, wsf, T, N, Kd, L, S, (float *)ws);
    g.act = (const bf16 *)w; // not read (x is); any valid address
    g.x = x;
    g.n_pairs = T;
    g.tile_rows = T;
    const size_t smem = moe_b_layout<C, WF>::bytes + (size_t)C::A_PARTS * T * L * 2;
    // the ranges added in a cluster: after x's rows, the block's sums [T, BN] in fp32
    if (S > 1 && bi_cluster() && launch_bi_cluster<C, WF>(g, S, smem + (size_t)T * C::BN * 4))
        return;
    launch_gemm<C, false, false, true, WF>(g, S, smem); // one tile, S ranges
    if (S > 1) bi_reduce(out, g.part, T, N, S);
}

// L: the k of a range (bi_split_len; Kd or more: one range).
template <class C, int WF = WF_BF16>
static void bi_run(float *out, const float *x, const void *w, const float *wsf, int T, int N,
                   int Kd, int L) {
    static_assert(BI_SPLIT_UNIT % C::BK == 0, "a range is whole k tiles of every shape");
    const int BM = C::BM;
    const int max_tiles = (T + BM - 1) / BM;
    const int S = (Kd + L - 1) / L;
    // a few rows whose x fits beside the weight stages (BI_SMALL_A_BYTES): one launch fewer. The
    // tiles of one row of warps only (decode and middle shapes, which the tests run this way); the
    // prefill shape (medium, 97 to 128 rows of a small weight) keeps the prepare kernel.
    if (C::WARPS_M == 1 && T <= C::BM && (size_t)C::A_PARTS * T * L * 2 <= BI_SMALL_A_BYTES) {
        bi_run_small<C, WF>(out, x, w, wsf, T, N, Kd, L);
        return;
    }
    const size_t AP = C::A_PARTS;
    const moe_prep_layout l = prep_layout(1, T, max_tiles, AP, T, Kd);
    const size_t o_part = l.end;
    const size_t total = align256(o_part + (S > 1 ? (size_t)S * T * N * 4 : 0));
    unsigned char *ws = moe_workspace(total);
    // topk_ids NULL: every row to expert 0
    const moe_prep_args p = prep_launch(ws, l, C::SPLIT, x, nullptr, T, 1, Kd, 1, BM, nullptr);

    moe_gemm_args g = bi_args<C, WF>(out, w, wsf, T, N, Kd, L, S, (float *)(ws + o_part));
    g.tiles = p.tiles;
    g.n_tiles = p.n_tiles;
    g.pairs = p.pairs;
    g.act = p.xb;
    g.act_lo = C::SPLIT ? (int64_t)T * Kd : 0;
    g.wait_first = 1;
    launch_gemm<C, false, false, false, WF>(g, max_tiles * S);
    if (S > 1) bi_reduce(out, g.part, T, N, S);
}

// Prefill sizes on the wgmma kernel (bf16_gemm.cu): the prepare kernel (x in BF16, split: and its
// lo parts; every row to expert 0 in row order), the ranges of L into part, then their sums in
// order (bi_reduce). The same ranges and adds as bi_run's; within a range the wgmma kernel's sums
// (medium: the mma.sync tiles'; high: one chain, as the ONE tiles').
static void bi_run_wgmma(float *out, const float *x, const void *w, int T, int N, int Kd, int L,
                         bool split) {
    const int S = (Kd + L - 1) / L, max_tiles = (T + 127) / 128;
    const size_t AP = split ? 2 : 1;
    const moe_prep_layout l = prep_layout(1, T, max_tiles, AP, T, Kd);
    const size_t o_part = l.end;
    unsigned char *ws = moe_workspace(align256(o_part + (S > 1 ? (size_t)S * T * N * 4 : 0)));
    const moe_prep_args p = prep_launch(ws, l, split, x, nullptr, T, 1, Kd, 1, 128, nullptr);
    float *part = (float *)(ws + o_part);
    bf16_wgmma_linear(out, part, p.xb, p.pairs, p.offsets, (const bf16 *)w, T, N, Kd, L, split);
    if (S > 1) bi_reduce(out, part, T, N, S);
}

// Outside deterministic mode the ranges follow T too: none (one range, no partial sums to store
// and add) once the tiles alone make g_free_blocks blocks, else about that many blocks.
static int g_free_blocks = BI_TARGET_BLOCKS;
extern "C" int cuda_linear_tiles_blocks(int blocks) { // tests/test_cuda_ops.c: returns the old
    const int old = g_free_blocks;
    g_free_blocks = blocks > 0 ? blocks : BI_TARGET_BLOCKS;
    return old;
}
static int free_split_len(int64_t tiles, int Kd) {
    const int units = (Kd + BI_SPLIT_UNIT - 1) / BI_SPLIT_UNIT;
    const int64_t want =
        std::max<int64_t>(1, std::min<int64_t>(units, (g_free_blocks + tiles - 1) / tiles));
    return (int)((units + want - 1) / want) * BI_SPLIT_UNIT;
}

// One tile shape C below the wgmma kernel's sizes: the ranges fixed by the shape (deterministic
// mode), or by T and the shape.
template <class C>
static void bi_run_by(float *out, const float *x, const void *w, int T, int N, int Kd, bool fixed) {
    const int64_t tiles = (int64_t)((T + C::BM - 1) / C::BM) * ((N + C::BN - 1) / C::BN);
    bi_run<C>(out, x, w, nullptr, T, N, Kd,
              fixed ? bi_split_len(N, Kd) : free_split_len(tiles, Kd));
}

// The tile shape follows T as moe_dispatch's does with one expert; with fixed ranges the bits do
// not depend on it. High precision with weights the wgmma kernel takes (bf16_wgmma_linear_takes:
// a matter of the shape alone) sums in one chain at every T, so that the kernel can take the
// prefill sizes.
static void linear_tiles(float *out, const float *x, const void *w, int T, int N, int Kd,
                         bool fixed) {
    if (T <= 0 || N <= 0) return;
    MS_ASSERT(Kd % 8 == 0 && N % 8 == 0 && ((uintptr_t)x & 15) == 0 && ((uintptr_t)w & 15) == 0);
    const bool medium = ops_cuda_matmul_precision() == MATMUL_PRECISION_MEDIUM;
    const bool wg = bf16_wgmma_linear_takes(N, Kd, !medium);
    if (wg && T > 96) {
        const int64_t tiles = (int64_t)((T + 127) / 128) * (N / (medium ? 256 : 128));
        bi_run_wgmma(out, x, w, T, N, Kd, fixed ? bi_split_len(N, Kd) : free_split_len(tiles, Kd),
                     !medium);
    } else if (medium) {
        if (T <= 12)
            bi_run_by<moe_cfg_decode>(out, x, w, T, N, Kd, fixed);
        else if (T <= 48)
            bi_run_by<moe_cfg_mid>(out, x, w, T, N, Kd, fixed);
        else if (T <= 96)
            bi_run_by<moe_cfg_mid_wide>(out, x, w, T, N, Kd, fixed);
        else
            bi_run_by<moe_cfg_prefill>(out, x, w, T, N, Kd, fixed);
    } else if (wg) {
        if (T <= 12)
            bi_run_by<moe_cfg_decode_one>(out, x, w, T, N, Kd, fixed);
        else
            bi_run_by<moe_cfg_mid_one>(out, x, w, T, N, Kd, fixed);
    } else {
        if (T <= 12)
            bi_run_by<moe_cfg_decode_high>(out, x, w, T, N, Kd, fixed);
        else if (T <= 96)
            bi_run_by<moe_cfg_mid_high>(out, x, w, T, N, Kd, fixed);
        else
            bi_run_by<moe_cfg_prefill_high>(out, x, w, T, N, Kd, fixed);
    }
}

void cuda_linear_bi(float *out, const float *x, const void *w, int T, int N, int Kd) {
    linear_tiles(out, x, w, T, N, Kd, true);
}

void cuda_linear_tiles(float *out, const float *x, const void *w, int T, int N, int Kd) {
    linear_tiles(out, x, w, T, N, Kd, false);
}

// ---------------------------------------------------------------------------------------------
// Dense FP8 weights (W8A16): linear_bi's kernels on E4M3 codes
// ---------------------------------------------------------------------------------------------
// A dense projection stored in block FP8 runs as the routed experts' FP8 path does (the header):
// codes decoded to BF16 in registers, each 128-k block's sums times its row's scale, through
// linear_bi's one-expert grouping. Ranges of k are whole 128-k blocks (BI_SPLIT_UNIT), so the
// block sums are those of one range; the tile shapes are the experts' FP8 ones (decode, then the
// middle shape at every larger size). fixed_ranges (deterministic mode): the ranges follow the
// weight's shape alone, so a row is the same bits at every T; otherwise, once the tiles alone
// fill the GPU (BI_TARGET_BLOCKS), one range: no partial sums to store and add.

// The tensor: codes [N, K] then, at the next 256 bytes, the row scales [ceil(K / 128), N] fp32.
static size_t fp8_linear_scales_at(int64_t N, int64_t K) { return align256((size_t)(N * K)); }

int cuda_prepare_linear_fp8(tensor *t, const uint8_t *codes, const float *row_scales, int N,
                            int K, char *err, size_t errlen) {
    if (N <= 0 || K <= 0 || N % 8 || K % 64)
        return set_err(err, errlen, "CUDA: an FP8 linear needs N=%d a multiple of 8, K=%d of 64",
                       N, K);
    const size_t nks = (size_t)(K + QUANT_FP8_BLOCK - 1) / QUANT_FP8_BLOCK * N;
    if (!fp8_scales_finite(row_scales, nks))
        return set_err(err, errlen, "CUDA: an FP8 linear [%d, %d]: a block scale "
                                    "(weight_scale_inv) is not finite", N, K);
    const size_t at = fp8_linear_scales_at(N, K), bytes = at + nks * sizeof(float);
    unsigned char *host = (unsigned char *)calloc(1, bytes);
    if (!host) return set_err(err, errlen, "CUDA: out of host memory staging an FP8 linear");
    memcpy(host, codes, (size_t)N * K);
    memcpy(host + at, row_scales, nks * sizeof(float));
    const void *src[1] = {host};
    void *dst[1] = {};
    int bad_h = 0;
    const int64_t n_chunks = (int64_t)N * K / 64;
    const cudaError_t ce = upload_packed(1, src, &bytes, dst, [&](int *bad) {
        fp8_pack_kernel<<<(unsigned)((n_chunks + 255) / 256), 256, 0, cuda_stream()>>>(
            (uint8_t *)dst[0], n_chunks, bad);
    }, &bad_h);
    free(host);
    if (ce != cudaSuccess || bad_h) {
        if (bad_h) return set_err(err, errlen, "CUDA: an FP8 linear [%d, %d]: a code is NaN", N, K);
        return set_err(err, errlen, "CUDA: copying an FP8 linear [%d, %d]: %s", N, K,
                       cudaGetErrorString(ce));
    }
    *t = (tensor){.dtype = DTYPE_F8_E4M3, .ndim = 2, .shape = {N, K}, .data = dst[0],
                  .device = DEVICE_CUDA};
    return 0;
}

const float *cuda_linear_fp8_scales(const tensor *w) {
    return reinterpret_cast<const float *>((const unsigned char *)w->data +
                                           fp8_linear_scales_at(w->shape[0], w->shape[1]));
}

// One tile shape: the ranges (above), then linear_bi's run.
template <class C>
static void fp8_linear_run(float *out, const float *x, const tensor *w, const float *wsf, int T,
                           int N, int Kd, bool fixed_ranges) {
    const int64_t tile_blocks = (int64_t)((T + C::BM - 1) / C::BM) * ((N + C::BN - 1) / C::BN);
    const int L = fixed_ranges || tile_blocks < BI_TARGET_BLOCKS
                      ? bi_split_len(N, Kd)
                      : (Kd + BI_SPLIT_UNIT - 1) / BI_SPLIT_UNIT * BI_SPLIT_UNIT;
    bi_run<C, WF_FP8>(out, x, w->data, wsf, T, N, Kd, L);
}

void cuda_linear_fp8(float *out, const float *x, const tensor *w, int T, int N, int Kd,
                     bool fixed_ranges) {
    if (T <= 0 || N <= 0) return;
    MS_ASSERT(w->dtype == DTYPE_F8_E4M3 && w->device == DEVICE_CUDA && w->shape[0] == N &&
              w->shape[1] == Kd && Kd % 64 == 0 && N % 8 == 0 && ((uintptr_t)x & 15) == 0);
    const float *wsf = cuda_linear_fp8_scales(w);
    const bool medium = ops_cuda_matmul_precision() == MATMUL_PRECISION_MEDIUM;
    if (T <= 12) {
        if (medium)
            fp8_linear_run<moe_cfg_decode>(out, x, w, wsf, T, N, Kd, fixed_ranges);
        else
            fp8_linear_run<moe_cfg_decode_high>(out, x, w, wsf, T, N, Kd, fixed_ranges);
    } else if (medium) {
        fp8_linear_run<moe_cfg_mid>(out, x, w, wsf, T, N, Kd, fixed_ranges);
    } else {
        fp8_linear_run<moe_cfg_mid_high>(out, x, w, wsf, T, N, Kd, fixed_ranges);
    }
}
