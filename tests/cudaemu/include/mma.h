// tests/cudaemu/include/mma.h: nvcuda::wmma for the emulator, the part the
// kernels use: the m16n16k16 shape with __nv_bfloat16 operands (matrix_a,
// matrix_b; row_major or col_major) and float accumulators;
// fill_fragment, load_matrix_sync, store_matrix_sync, mma_sync.
//
// A fragment holds the whole 16×16 tile, row by row, in every lane: code
// that uses only these calls cannot see where a GPU puts the elements. The
// real per-lane placement is not modelled, so fragments deliberately have
// no x[] and no num_elements: a kernel that touches elements does not
// compile here (model the placement first).
//
// CUDA's rules that make real code break are enforced (the launch fails):
//   - every call is warp-collective: all 32 lanes of the warp call it
//     together (emu_warp_collective), at the same place, with the same
//     pointer, ldm, layout or fill value;
//   - the fragments the lanes pass in (the mma's a, b and c, a store's
//     source) hold the same contents in every lane (lanes that pass
//     different fragments show here);
//   - load and store pointers are 256-bit (32-byte) aligned; ldm is a
//     multiple of 8 elements for 16-bit types and of 4 for float (16 bytes).
// The memory access is the warp's, made when its last lane arrives (one
// converged instruction). mma_sync: d = c + a·b, each d[i][j] summed in
// float over k = 0..15 in order (the bf16 products are exact in float);
// a tensor core may add in another order, so results are not bit for bit a
// GPU's. d may be c.
#ifndef TESTS_CUDAEMU_MMA_H
#define TESTS_CUDAEMU_MMA_H

#include <stdint.h>
#include <string.h>

#include <type_traits>

#include "emu.h"
#include <cuda_bf16.h>

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int m, int n, int k, typename T, typename Layout = void>
class fragment {
    static_assert(m == 16 && n == 16 && k == 16, "the emulator has the m16n16k16 shape only");
    static_assert(std::is_same<Use, accumulator>::value
                      ? std::is_same<T, float>::value && std::is_void<Layout>::value
                      : (std::is_same<Use, matrix_a>::value || std::is_same<Use, matrix_b>::value) &&
                            std::is_same<T, __nv_bfloat16>::value &&
                            (std::is_same<Layout, row_major>::value ||
                             std::is_same<Layout, col_major>::value),
                  "the emulator has bf16 matrix_a / matrix_b fragments (row_major or col_major) "
                  "and float accumulators (no layout) only");

public:
    // [row][col] of the 16×16 tile: A (m×k), B (k×n) or the accumulator
    // (m×n). Not CUDA's API: only include/mma.h touches it.
    typedef T emu_element;
    T emu_tile[16 * 16];
};

namespace emu_detail {

template <typename T>
struct identity {
    typedef T type;
};

// A call's arguments, compared byte for byte between the lanes (so no
// uninitialised padding: made by mem_of).
struct mem_args {
    const void *p;
    const char *file;
    unsigned ldm;
    int col;  // column-major in memory
    int line;
    int pad;
};

inline mem_args mem_of(const void *p, unsigned ldm, int col, const char *file, int line)
{
    mem_args a;
    memset(&a, 0, sizeof a);
    a.p = p;
    a.file = file;
    a.ldm = ldm;
    a.col = col;
    a.line = line;
    return a;
}

inline void check_mem(const char *what, const void *p, unsigned ldm, size_t elem,
                      const char *file, int line)
{
    if ((uintptr_t)p % 32 != 0)
        emu_kernel_fault("%s at %s:%d: the pointer %p is not 256-bit (32-byte) aligned", what, file,
                         line, p);
    if (ldm % (16 / elem) != 0)
        emu_kernel_fault("%s at %s:%d: ldm %u is not a multiple of %zu (16 bytes of %zu-byte "
                         "elements)",
                         what, file, line, ldm, 16 / elem, elem);
}

// Element (r, c) of a 16×16 tile in memory: row-major p[r·ldm + c],
// column-major p[c·ldm + r].
inline size_t at(const mem_args &a, int r, int c)
{
    return a.col ? (size_t)c * a.ldm + (size_t)r : (size_t)r * a.ldm + (size_t)c;
}

template <typename F>
void check_same(const char *what, const char *name, void *const *data, const mem_args *where,
                const F *(*pick)(void *))
{
    const F *f0 = pick(data[0]);
    for (int l = 1; l < 32; l++)
        if (memcmp(pick(data[l])->emu_tile, f0->emu_tile, sizeof f0->emu_tile) != 0)
            emu_kernel_fault("%s at %s:%d: lane %d's %s fragment differs from lane 0's (the lanes "
                             "pass different fragments)",
                             what, where->file, where->line, l, name);
}

template <typename F>
void run_load(void *const *data, const void *args)
{
    const mem_args &a = *static_cast<const mem_args *>(args);
    typedef typename F::emu_element T;
    const T *p = static_cast<const T *>(a.p);
    T tile[256];
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < 16; c++)
            tile[r * 16 + c] = p[at(a, r, c)];
    for (int l = 0; l < 32; l++)
        memcpy(static_cast<F *>(data[l])->emu_tile, tile, sizeof tile);
}

typedef fragment<accumulator, 16, 16, 16, float> acc_t;

inline const acc_t *pick_acc(void *d) { return static_cast<const acc_t *>(d); }

inline void run_store(void *const *data, const void *args)
{
    const mem_args &a = *static_cast<const mem_args *>(args);
    check_same<acc_t>("wmma::store_matrix_sync", "accumulator", data, &a, pick_acc);
    float *p = const_cast<float *>(static_cast<const float *>(a.p));
    const acc_t *f = pick_acc(data[0]);
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < 16; c++)
            p[at(a, r, c)] = f->emu_tile[r * 16 + c];
}

template <typename F, typename T>
void run_fill(void *const *data, const void *args)
{
    T v;
    memcpy(&v, args, sizeof v);
    for (int l = 0; l < 32; l++)
        for (int e = 0; e < 256; e++)
            static_cast<F *>(data[l])->emu_tile[e] = v;
}

template <typename FA, typename FB>
struct mma_lane {
    acc_t *d;
    const FA *a;
    const FB *b;
    const acc_t *c;
};

struct mma_args {
    const char *file;
    int line;
    int pad;
};

template <typename FA, typename FB>
void run_mma(void *const *data, const void *args)
{
    const mma_args &m = *static_cast<const mma_args *>(args);
    const mem_args where = mem_of(NULL, 0, 0, m.file, m.line);
    typedef mma_lane<FA, FB> L;
    check_same<FA>("wmma::mma_sync", "matrix_a", data, &where,
                   [](void *d) { return static_cast<L *>(d)->a; });
    check_same<FB>("wmma::mma_sync", "matrix_b", data, &where,
                   [](void *d) { return static_cast<L *>(d)->b; });
    check_same<acc_t>("wmma::mma_sync", "accumulator (c)", data, &where,
                      [](void *d) { return static_cast<L *>(d)->c; });
    const L *l0 = static_cast<const L *>(data[0]);
    float a[256], b[256], d[256];
    for (int e = 0; e < 256; e++) {
        a[e] = __bfloat162float(l0->a->emu_tile[e]);
        b[e] = __bfloat162float(l0->b->emu_tile[e]);
    }
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 16; j++) {
            float s = l0->c->emu_tile[i * 16 + j];
            for (int k = 0; k < 16; k++)
                s += a[i * 16 + k] * b[k * 16 + j];
            d[i * 16 + j] = s;
        }
    for (int l = 0; l < 32; l++)
        memcpy(static_cast<L *>(data[l])->d->emu_tile, d, sizeof d);
}

}  // namespace emu_detail

// fill_fragment: every element v.
template <typename Use, int m, int n, int k, typename T, typename Layout>
inline void fill_fragment(fragment<Use, m, n, k, T, Layout> &a,
                          const typename emu_detail::identity<T>::type &v,
                          const char *file = __builtin_FILE(), int line = __builtin_LINE())
{
    unsigned char args[sizeof(T)];
    memcpy(args, &v, sizeof v);
    emu_warp_collective(file, line, "wmma::fill_fragment", args, sizeof args, &a,
                        emu_detail::run_fill<fragment<Use, m, n, k, T, Layout>, T>);
}

// matrix_a / matrix_b: the layout is the fragment's.
template <typename Use, typename T, typename Layout>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout> &a, const T *p, unsigned ldm,
                             const char *file = __builtin_FILE(), int line = __builtin_LINE())
{
    static_assert(!std::is_same<Use, accumulator>::value,
                  "an accumulator's load_matrix_sync takes a layout_t");
    emu_detail::check_mem("wmma::load_matrix_sync", p, ldm, sizeof(T), file, line);
    const emu_detail::mem_args args =
        emu_detail::mem_of(p, ldm, std::is_same<Layout, col_major>::value, file, line);
    emu_warp_collective(file, line, "wmma::load_matrix_sync", &args, sizeof args, &a,
                        emu_detail::run_load<fragment<Use, 16, 16, 16, T, Layout>>);
}

// The accumulator: the layout in memory is an argument.
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float> &a, const float *p,
                             unsigned ldm, layout_t layout, const char *file = __builtin_FILE(),
                             int line = __builtin_LINE())
{
    emu_detail::check_mem("wmma::load_matrix_sync", p, ldm, sizeof(float), file, line);
    const emu_detail::mem_args args =
        emu_detail::mem_of(p, ldm, layout == mem_col_major, file, line);
    emu_warp_collective(file, line, "wmma::load_matrix_sync", &args, sizeof args, &a,
                        emu_detail::run_load<fragment<accumulator, 16, 16, 16, float>>);
}

inline void store_matrix_sync(float *p, const fragment<accumulator, 16, 16, 16, float> &a,
                              unsigned ldm, layout_t layout, const char *file = __builtin_FILE(),
                              int line = __builtin_LINE())
{
    emu_detail::check_mem("wmma::store_matrix_sync", p, ldm, sizeof(float), file, line);
    const emu_detail::mem_args args =
        emu_detail::mem_of(p, ldm, layout == mem_col_major, file, line);
    emu_warp_collective(file, line, "wmma::store_matrix_sync", &args, sizeof args,
                        const_cast<fragment<accumulator, 16, 16, 16, float> *>(&a),
                        emu_detail::run_store);
}

// d = c + a·b (d may be c).
template <typename LA, typename LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float> &d,
                     const fragment<matrix_a, 16, 16, 16, __nv_bfloat16, LA> &a,
                     const fragment<matrix_b, 16, 16, 16, __nv_bfloat16, LB> &b,
                     const fragment<accumulator, 16, 16, 16, float> &c,
                     const char *file = __builtin_FILE(), int line = __builtin_LINE())
{
    typedef fragment<matrix_a, 16, 16, 16, __nv_bfloat16, LA> FA;
    typedef fragment<matrix_b, 16, 16, 16, __nv_bfloat16, LB> FB;
    emu_detail::mma_lane<FA, FB> me = { &d, &a, &b, &c };
    emu_detail::mma_args args;
    memset(&args, 0, sizeof args);
    args.file = file;
    args.line = line;
    emu_warp_collective(file, line, "wmma::mma_sync", &args, sizeof args, &me,
                        emu_detail::run_mma<FA, FB>);
}

}  // namespace wmma
}  // namespace nvcuda

#endif
