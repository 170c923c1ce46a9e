// tests/cudaemu/emu_test.cc: the kernels of cuda/*.cu, run by the CPU
// emulator (emu.h), against the CPU reference ops of expert/.
//
// The .cu files are transformed at build time (transform.py), so this
// checks the kernels as they are now. Every op runs on emulated device
// memory (guard pages after each buffer, outputs NaN until written); its
// queued work runs at the sync that follows, and a fault there (an
// out-of-bounds write, a deadlock, a divergent barrier, a host pointer
// handed to a kernel, ...) fails the case with the emulator's message.
//
// Tolerances are those of tests/test_cuda_ops.c (the same ops on a GPU);
// the step's updates, the bf16 cast, the embedding and the element-wise
// adds and products must be bit for bit the CPU's, as cuda/*.cu promise.
// Determinism: the outputs of a second and a third run, with the threads of
// each block and the blocks started in reverse and in random order, must be
// the same bits (a race between threads shows as a difference).
//
// Usage: emu_test [-v]. Exits 0 when every check passes, 1 otherwise.
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <string>
#include <vector>

#include <cuda_bf16.h>

#include "att_bf16_bound.h"
#include "emu.h"
#include "emu_ctx.h"
#include "selftest.h"

extern "C" {
#include "cuda/ops.h"
#include "expert/backend.h"
#include "expert/optim.h"
}

namespace {

const double U32 = 0x1p-24;  // fp32's unit roundoff

int g_fails, g_checks;
int g_verbose;
std::string g_case;
uint64_t g_rng;

// ---- Random numbers ----

void seed(uint64_t s) { g_rng = s * 0x9e3779b97f4a7c15ull + 1; }

uint32_t rnd32()
{
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 16);
}

float urand(float scale) { return ((float)rnd32() / 4294967296.0f * 2.0f - 1.0f) * scale; }

std::vector<float> rnd(size_t n, float scale)
{
    std::vector<float> v(n);
    for (auto &x : v)
        x = urand(scale);
    return v;
}

// ---- Reporting ----

void report(bool ok, const std::string &what, const std::string &detail)
{
    g_checks++;
    if (!ok)
        g_fails++;
    if (!ok || g_verbose)
        printf("%s %s: %s%s%s\n", ok ? "ok  " : "FAIL", g_case.c_str(), what.c_str(),
               detail.empty() ? "" : ": ", detail.c_str());
}

void check_true(const std::string &what, bool ok) { report(ok, what, ""); }

// |got - want| <= atol + rtol·|want| everywhere (NaN fails).
void check_close(const std::string &what, const float *got, const float *want, size_t n,
                 double atol, double rtol)
{
    size_t bad = 0, worst = 0, nonfinite = 0;
    double wq = 0, maxabs = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - (double)want[i]);
        nonfinite += isfinite(got[i]) != isfinite(want[i]);
        double tol = atol + rtol * fabs((double)want[i]);
        if (!(d <= tol)) {
            if (bad < 4)
                printf("  %s %s [%zu]: got %.9g want %.9g\n", g_case.c_str(), what.c_str(), i,
                       (double)got[i], (double)want[i]);
            bad++;
        }
        double q = tol > 0 ? d / tol : (d > 0 ? INFINITY : 0);
        if (!(q <= wq)) {
            wq = q;
            worst = i;
        }
        if (d > maxabs)
            maxabs = d;
    }
    char buf[256];
    snprintf(buf, sizeof buf, "n %zu, max |diff| %.3g, worst |diff|/tol %.3g at [%zu]", n, maxabs,
             wq, worst);
    if (bad)
        snprintf(buf + strlen(buf), sizeof buf - strlen(buf),
                 "; %zu out of tolerance, %zu of them not finite where the CPU's are (or the reverse)",
                 bad, nonfinite);
    report(bad == 0, what, buf);
}

// |got - want| <= atol + bound[i] everywhere (NaN fails): a bound per
// element (att_bf16_bound.h).
void check_bound(const std::string &what, const float *got, const float *want, const float *bound,
                 size_t n, double atol)
{
    size_t bad = 0, worst = 0;
    double wq = 0, maxabs = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - (double)want[i]);
        double tol = atol + (double)bound[i];
        if (!(d <= tol)) {
            if (bad < 4)
                printf("  %s %s [%zu]: got %.9g want %.9g bound %.3g\n", g_case.c_str(), what.c_str(),
                       i, (double)got[i], (double)want[i], tol);
            bad++;
        }
        double q = d / tol;
        if (!(q <= wq)) {
            wq = q;
            worst = i;
        }
        if (d > maxabs)
            maxabs = d;
    }
    char buf[256];
    snprintf(buf, sizeof buf, "n %zu, max |diff| %.3g, worst |diff|/bound %.3g at [%zu]", n, maxabs,
             wq, worst);
    if (bad)
        snprintf(buf + strlen(buf), sizeof buf - strlen(buf), "; %zu out of bounds", bad);
    report(bad == 0, what, buf);
}

void check_bits(const std::string &what, const void *got, const void *want, size_t bytes)
{
    size_t first = bytes;
    for (size_t i = 0; i < bytes && first == bytes; i++)
        if (((const unsigned char *)got)[i] != ((const unsigned char *)want)[i])
            first = i;
    char buf[128];
    if (first == bytes)
        snprintf(buf, sizeof buf, "%zu bytes, bit for bit", bytes);
    else
        snprintf(buf, sizeof buf, "%zu bytes; the first difference at byte %zu", bytes, first);
    report(first == bytes, what, buf);
}

void check_d(const std::string &what, double got, double want, double rtol)
{
    double d = fabs(got - want);
    bool ok = d <= rtol * fabs(want) || (got == want);
    char buf[160];
    snprintf(buf, sizeof buf, "got %.17g want %.17g (rtol %.3g)", got, want, rtol);
    report(ok, what, buf);
}

void check_rc(const std::string &what, int rc, int want)
{
    char buf[160];
    snprintf(buf, sizeof buf, "returned %d, want %d%s%s", rc, want, rc ? "; " : "",
             rc ? expert_backend_last_error() : "");
    report(rc == want, what, buf);
}

// Runs the queued work; a fault fails the case (and the device is reset).
bool synced(const char *what)
{
    cudaError_t e = emu_sync();
    if (e != cudaSuccess) {
        report(false, std::string(what) + ": the emulated device faulted",
               std::string(cudaGetErrorName(e)) + ": " + emu_last_fault());
        emu_reset_device();
        return false;
    }
    return true;
}

void show_kernels()
{
    char buf[1024];
    emu_kernel_log(buf, sizeof buf);
    if (g_verbose)
        printf("     %s: kernels %s\n", g_case.c_str(), buf);
}

// ---- Emulated device memory, freed when the case ends ----

struct Dev {
    std::vector<void *> held;
    ~Dev()
    {
        emu_sync();
        for (void *p : held)
            emu_device_free(p);
    }
    // n elements, all bytes 0xFF (NaN as float), at element offset `off`
    // of an allocation of n + off (off > 0: an unaligned tensor).
    template <typename T>
    T *alloc(size_t n, size_t off = 0)
    {
        T *p = (T *)emu_device_malloc((n + off) * sizeof(T));
        if (!p) {
            fprintf(stderr, "emu_test: out of memory\n");
            exit(1);
        }
        memset((void *)p, 0xFF, (n + off) * sizeof(T));
        held.push_back(p);
        return p + off;
    }
    template <typename T>
    T *up(const std::vector<T> &h, size_t off = 0)
    {
        T *p = alloc<T>(h.size(), off);
        if (!h.empty())
            memcpy((void *)p, h.data(), h.size() * sizeof(T));
        return p;
    }
};

// The device's n elements at p (after the queued work ran).
template <typename T>
std::vector<T> down(const T *p, size_t n)
{
    if (!synced("reading back"))
        return std::vector<T>(n, T());
    return std::vector<T>(p, p + n);
}

std::vector<unsigned char> bytes_of(const void *p, size_t n)
{
    return std::vector<unsigned char>((const unsigned char *)p, (const unsigned char *)p + n);
}

// Runs `run` (which does the op and returns its outputs' bytes) with the
// threads and blocks in forward order, then reverse, then random order:
// the same bits each time.
template <typename F>
void deterministic(const std::string &what, F run)
{
    emu_set_schedule(EMU_ORDER_FORWARD, 0);
    std::vector<unsigned char> a = run();
    emu_set_schedule(EMU_ORDER_REVERSE, 0);
    std::vector<unsigned char> b = run();
    emu_set_schedule(EMU_ORDER_RANDOM, 0x5eed0000u + (uint64_t)g_checks);
    std::vector<unsigned char> c = run();
    emu_set_schedule(EMU_ORDER_FORWARD, 0);
    bool same = a == b && a == c && !a.empty();
    char buf[160];
    snprintf(buf, sizeof buf, "%zu bytes the same in forward, reverse and random thread and block order",
             a.size());
    report(same, what + " (determinism)", same ? buf : "the outputs differ between schedules");
}

// ---- The step: sqnorm, AdamW, SGD, the bf16 cast ----

void test_sqnorm()
{
    const size_t sizes[] = { 0, 1, 4096, 4097, 3 * 4096 + 7, 100003 };
    for (size_t n : sizes) {
        g_case = "sqnorm n=" + std::to_string(n);
        seed(n + 1);
        Dev dev;
        std::vector<float> x = rnd(n, 3);
        float *d = dev.up(x, 1);  // at an odd offset
        double cpu = NAN, g = NAN;
        check_rc("expert_sqnorm_op", expert_sqnorm_op(&cpu, x.data(), n), 0);
        check_rc("cuda_sqnorm", cuda_sqnorm(&g, d, n), 0);
        // The op waits for its result: g is set before any sync of ours.
        if (n == 0) {
            check_true("Σ x² of nothing is 0 (written)", g == 0.0 && cpu == 0.0);
            continue;
        }
        long double ex = 0;
        for (float v : x)
            ex += (long double)v * v;
        check_d("Σ x² vs expert_sqnorm_op", g, cpu, 1e-12);
        check_d("Σ x² vs exact", g, (double)ex, 1e-13);
        deterministic("Σ x²", [&] {
            double r = NAN;
            cuda_sqnorm(&r, d, n);
            return bytes_of(&r, sizeof r);
        });
        show_kernels();
    }
}

// What the update's sums hold, over the CPU's outputs, in long double.
void exact_sums(const std::vector<float> &p_out, const std::vector<float> &p_in, double out[2])
{
    long double dd = 0, pp = 0;
    for (size_t i = 0; i < p_out.size(); i++) {
        float d = p_out[i] - p_in[i];
        dd += (long double)d * d;
        pp += (long double)p_out[i] * p_out[i];
    }
    out[0] = (double)dd;
    out[1] = (double)pp;
}

void check_sums(const double gs[2], const double cs[2], const double init[2],
                const std::vector<float> &c_p, const std::vector<float> &p, int nonfinite)
{
    if (nonfinite) {
        check_true("a non-finite gradient gives a non-finite sums[1]", !isfinite(gs[1]));
        return;
    }
    double ex[2];
    exact_sums(c_p, p, ex);
    // The CPU keeps its sums in float lanes; these are double.
    double lanes = 1e-6 + 4 * U32 * sqrt((double)p.size() / 16 + 1);
    check_d("sums[0] += Σ Δp² vs exact", gs[0], init[0] + ex[0], 1e-12);
    check_d("sums[1] += Σ p'² vs exact", gs[1], init[1] + ex[1], 1e-12);
    check_d("sums[0] vs the CPU's", gs[0] - init[0], cs[0], lanes);
    check_d("sums[1] vs the CPU's", gs[1] - init[1], cs[1], lanes);
}

void adamw_case(size_t n, uint64_t t, float wd, int nonfinite)
{
    struct expert_optim o;
    expert_optim_default_adamw(&o);
    o.lr = 3e-3f;
    o.weight_decay = wd;
    char nm[160];
    snprintf(nm, sizeof nm, "adamw n=%zu t=%llu wd=%g%s", n, (unsigned long long)t, (double)wd,
             nonfinite == 1 ? " NaN gradient" : nonfinite == 2 ? " Inf gradient" : "");
    g_case = nm;
    seed(n * 31 + t);
    const float gscale = 0.7f;
    std::vector<float> p = rnd(n, 1), g = rnd(n, 2), m(n, 0.0f), v(n, 0.0f);
    if (t > 1) {
        m = rnd(n, 0.1f);
        for (auto &x : v)
            x = fabsf(urand(0.01f));
    }
    if (nonfinite)
        g[n / 2] = nonfinite == 1 ? NAN : INFINITY;
    std::vector<float> c_p(n), c_m = m, c_v = v;
    double cs[2] = { 0, 0 };
    check_rc("expert_adamw_op", expert_adamw_op(c_p.data(), p.data(), g.data(), c_m.data(), c_v.data(),
                                                n, gscale, &o, t, cs),
             0);
    Dev dev;
    float *d_p = dev.up(p), *d_g = dev.up(g, 1), *d_m = dev.up(m), *d_v = dev.up(v);
    float *d_po = dev.alloc<float>(n);
    double init[2] = { nonfinite ? 0 : cs[0], nonfinite ? 0 : cs[1] };
    double gs[2] = { init[0], init[1] };
    check_rc("cuda_adamw_update", cuda_adamw_update(d_po, d_p, d_g, d_m, d_v, n, gscale, &o, t, gs), 0);
    std::vector<float> g_p = down(d_po, n), g_m = down(d_m, n), g_v = down(d_v, n);
    check_bits("p_out vs expert_adamw_op", g_p.data(), c_p.data(), n * 4);
    check_bits("m vs expert_adamw_op", g_m.data(), c_m.data(), n * 4);
    check_bits("v vs expert_adamw_op", g_v.data(), c_v.data(), n * 4);
    check_bits("p_in unchanged", down(d_p, n).data(), p.data(), n * 4);
    check_sums(gs, cs, init, c_p, p, nonfinite);
    if (n > 4096 && !nonfinite)
        deterministic("p_out, m, v, sums", [&] {
            memcpy(d_m, m.data(), n * 4);
            memcpy(d_v, v.data(), n * 4);
            double s[2] = { 0, 0 };
            cuda_adamw_update(d_po, d_p, d_g, d_m, d_v, n, gscale, &o, t, s);
            synced("adamw");
            std::vector<unsigned char> r = bytes_of(d_po, n * 4), a = bytes_of(d_m, n * 4),
                                       b = bytes_of(d_v, n * 4), c = bytes_of(s, sizeof s);
            r.insert(r.end(), a.begin(), a.end());
            r.insert(r.end(), b.begin(), b.end());
            r.insert(r.end(), c.begin(), c.end());
            return r;
        });
    show_kernels();
}

void sgd_case(size_t n, float momentum, float wd, int warm, int nonfinite)
{
    struct expert_optim o;
    expert_optim_default_sgd(&o);
    o.momentum = momentum;
    o.weight_decay = wd;
    char nm[160];
    snprintf(nm, sizeof nm, "sgd n=%zu momentum=%g wd=%g%s%s", n, (double)momentum, (double)wd,
             warm ? " warm" : "",
             nonfinite == 1 ? " NaN gradient" : nonfinite == 2 ? " Inf gradient" : "");
    g_case = nm;
    seed(n * 17 + (uint64_t)warm);
    const float gscale = 0.7f;
    std::vector<float> p = rnd(n, 1), g = rnd(n, 2), buf = warm ? rnd(n, 0.5f) : std::vector<float>(n, 0.0f);
    if (nonfinite)
        g[n / 2] = nonfinite == 1 ? NAN : INFINITY;
    std::vector<float> c_p(n), c_buf = buf;
    double cs[2] = { 0, 0 };
    check_rc("expert_sgd_op",
             expert_sgd_op(c_p.data(), p.data(), g.data(), c_buf.data(), n, gscale, &o, cs), 0);
    Dev dev;
    float *d_p = dev.up(p), *d_g = dev.up(g), *d_buf = dev.up(buf), *d_po = dev.alloc<float>(n);
    double init[2] = { nonfinite ? 0 : cs[0], nonfinite ? 0 : cs[1] };
    double gs[2] = { init[0], init[1] };
    check_rc("cuda_sgd_update", cuda_sgd_update(d_po, d_p, d_g, d_buf, n, gscale, &o, gs), 0);
    check_bits("p_out vs expert_sgd_op", down(d_po, n).data(), c_p.data(), n * 4);
    check_bits("momentum buffer vs expert_sgd_op", down(d_buf, n).data(), c_buf.data(), n * 4);
    check_sums(gs, cs, init, c_p, p, nonfinite);
    if (n > 4096 && !nonfinite)
        deterministic("p_out, buf, sums", [&] {
            memcpy(d_buf, buf.data(), n * 4);
            double s[2] = { 0, 0 };
            cuda_sgd_update(d_po, d_p, d_g, d_buf, n, gscale, &o, s);
            synced("sgd");
            std::vector<unsigned char> r = bytes_of(d_po, n * 4), a = bytes_of(d_buf, n * 4),
                                       c = bytes_of(s, sizeof s);
            r.insert(r.end(), a.begin(), a.end());
            r.insert(r.end(), c.begin(), c.end());
            return r;
        });
    show_kernels();
}

void test_step()
{
    test_sqnorm();
    adamw_case(1, 1, 0, 0);
    adamw_case(4096, 1, 0, 0);
    adamw_case(4097, 1, 0, 0);
    adamw_case(4097, 7, 0.1f, 0);
    adamw_case(20011, 1000, 0.01f, 0);
    adamw_case(4097, 3, 0.1f, 1);
    adamw_case(4097, 3, 0, 2);
    sgd_case(1, 0.9f, 0, 0, 0);
    sgd_case(4097, 0.9f, 0, 1, 0);
    sgd_case(8192, 0, 0.01f, 0, 0);
    sgd_case(20011, 0.9f, 0.01f, 1, 0);
    sgd_case(4097, 0.9f, 0, 1, 1);
    sgd_case(4097, 0.9f, 0, 1, 2);
}

float f32_of(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

void test_cast()
{
    g_case = "cast_bf16";
    static const uint32_t special[] = {
        0x00000000u, 0x80000000u, 0x3f800000u, 0xbf800000u, 0x3f808000u, 0x3f818000u,
        0x3f808001u, 0x3f807fffu, 0xbf818000u, 0x7f7fffffu, 0x7f7f8000u, 0x7f7f7fffu,
        0x00000001u, 0x00008000u, 0x00018000u, 0x807fffffu, 0x7f800000u, 0xff800000u,
        0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu, 0x7f810000u,
    };
    const size_t ns = sizeof special / sizeof special[0], n = ns + 60013;
    seed(77);
    std::vector<float> src(n);
    for (size_t i = 0; i < n; i++)
        src[i] = i < ns ? f32_of(special[i]) : i % 2 ? f32_of(rnd32() ^ (rnd32() << 16)) : urand(1);
    std::vector<uint16_t> cpu(n);
    check_rc("expert_cast_bf16", expert_cast_bf16(cpu.data(), src.data(), n), 0);
    Dev dev;
    float *d_src = dev.up(src, 1);
    uint16_t *d_dst = dev.alloc<uint16_t>(n, 1);  // d_dst[-1] stays 0xFFFF
    check_rc("cuda_cast_bf16", cuda_cast_bf16(d_dst, d_src, n), 0);
    std::vector<uint16_t> got = down(d_dst - 1, n + 1);
    check_bits("dst vs expert_cast_bf16 (specials, random bits, at odd offsets)", got.data() + 1,
               cpu.data(), n * 2);
    check_true("the element before dst untouched", got[0] == 0xFFFF);
    // CUDA's __float2bfloat16_rn (the emulator's cuda_bf16.h): the same
    // rounding, every NaN the canonical 0x7fff.
    size_t diff = 0;
    for (size_t i = 0; i < n; i++) {
        uint16_t h = __bfloat16_as_ushort(__float2bfloat16_rn(src[i]));
        diff += isnan(src[i]) ? h != 0x7fff : h != cpu[i];
    }
    check_true("__float2bfloat16_rn rounds as expert_cast_bf16", diff == 0);
    check_rc("n = 0", cuda_cast_bf16(d_dst, d_src, 0), 0);
    check_rc("NULL dst", cuda_cast_bf16(NULL, d_src, 1), -EINVAL);
    deterministic("dst", [&] {
        cuda_cast_bf16(d_dst, d_src, n);
        synced("cast");
        return bytes_of(d_dst, n * 2);
    });
    show_kernels();
}

// ---- Attention ----

struct att_case {
    int B, T, C, NH;
    int optin;   // the device's opt-in shared memory per block
    float loose; // tolerance multiplier
    bool det;    // also the determinism runs
};

void att_run(const att_case &a)
{
    const int B = a.B, T = a.T, C = a.C, NH = a.NH, hd = C / NH;
    const size_t rows = (size_t)B * T, nqkv = rows * 3 * C, nout = rows * C;
    char nm[160];
    snprintf(nm, sizeof nm, "attention B=%d T=%d C=%d NH=%d (hd %d) optin=%d", B, T, C, NH, hd,
             a.optin);
    g_case = nm;
    seed((uint64_t)(B * 1000003 + T * 1009 + C * 7 + NH));
    emu_set_smem_optin(a.optin);
    std::vector<float> qkv(nqkv), dout = rnd(nout, 1);
    for (size_t r = 0; r < rows; r++)
        for (int c = 0; c < 3 * C; c++)
            qkv[r * 3 * C + c] = urand(c < 2 * C ? 3.0f : 1.0f);

    const size_t natt = (size_t)B * NH * T * T;
    std::vector<float> r_out(nout), r_att(natt), r_scr(natt), r_dqkv(nqkv);
    check_rc("expert_attention_forward",
             expert_attention_forward(r_out.data(), r_att.data(), qkv.data(), B, T, C, NH), 0);
    check_rc("expert_attention_backward",
             expert_attention_backward(r_dqkv.data(), r_scr.data(), dout.data(), qkv.data(),
                                       r_att.data(), B, T, C, NH),
             0);
    // The log-sum-exp of each row, in double, from the same float scores'
    // inputs (scale as the kernels take it: a float).
    const float scale = (float)(1.0 / sqrt((double)hd));
    std::vector<float> r_lse((size_t)B * NH * T);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int i = 0; i < T; i++) {
                std::vector<double> s(i + 1);
                double m = -INFINITY, l = 0;
                for (int j = 0; j <= i; j++) {
                    double dot = 0;
                    for (int d = 0; d < hd; d++)
                        dot += (double)qkv[((size_t)b * T + i) * 3 * C + h * hd + d] *
                               qkv[((size_t)b * T + j) * 3 * C + C + h * hd + d];
                    s[j] = dot * scale;
                    m = s[j] > m ? s[j] : m;
                }
                for (int j = 0; j <= i; j++)
                    l += exp(s[j] - m);
                r_lse[((size_t)b * NH + h) * T + i] = (float)(m + log(l));
            }

    size_t ns = 0, nsc = 0;
    cuda_attention_sizes(T, NH, &ns, &nsc);
    check_true("cuda_attention_sizes: NH·T saved and scratch floats per sequence",
               ns == (size_t)NH * T && nsc == (size_t)NH * T);
    Dev dev;
    float *d_qkv = dev.up(qkv), *d_dout = dev.up(dout), *d_out = dev.alloc<float>(nout);
    float *d_saved = dev.alloc<float>((size_t)B * ns), *d_scr = dev.alloc<float>((size_t)B * nsc);
    float *d_dqkv = dev.alloc<float>(nqkv);
    const float L = a.loose;
    check_rc("cuda_attention_forward", cuda_attention_forward(d_out, d_saved, d_qkv, B, T, C, NH), 0);
    check_close("out", down(d_out, nout).data(), r_out.data(), nout, 3e-5 * L, 3e-4 * L);
    check_close("saved log-sum-exp", down(d_saved, (size_t)B * ns).data(), r_lse.data(),
                (size_t)B * ns, 1e-5, 1e-5);
    check_rc("cuda_attention_backward",
             cuda_attention_backward(d_dqkv, d_scr, d_dout, d_out, d_qkv, d_saved, B, T, C, NH), 0);
    std::vector<float> g = down(d_dqkv, nqkv);
    static const char *part[3] = { "dq", "dk", "dv" };
    for (int p = 0; p < 3; p++) {
        std::vector<float> gp(nout), rp(nout);
        for (size_t r = 0; r < rows; r++)
            for (int c = 0; c < C; c++) {
                gp[r * C + c] = g[r * 3 * C + (size_t)p * C + c];
                rp[r * C + c] = r_dqkv[r * 3 * C + (size_t)p * C + c];
            }
        check_close(part[p], gp.data(), rp.data(), nout, 2e-4 * L, 2e-3 * L);
    }
    if (a.det)
        deterministic("out, saved, dqkv", [&] {
            memset(d_out, 0xFF, nout * 4);
            memset(d_dqkv, 0xFF, nqkv * 4);
            cuda_attention_forward(d_out, d_saved, d_qkv, B, T, C, NH);
            cuda_attention_backward(d_dqkv, d_scr, d_dout, d_out, d_qkv, d_saved, B, T, C, NH);
            synced("attention");
            std::vector<unsigned char> r = bytes_of(d_out, nout * 4),
                                       s = bytes_of(d_saved, (size_t)B * ns * 4),
                                       q = bytes_of(d_dqkv, nqkv * 4);
            r.insert(r.end(), s.begin(), s.end());
            r.insert(r.end(), q.begin(), q.end());
            return r;
        });
    show_kernels();
    emu_set_smem_optin(232448);
}

void test_attention()
{
    const int H100 = 232448;
    const att_case cases[] = {
        { 2, 1, 64, 4, H100, 1, false },     // T = 1
        { 1, 1, 256, 2, H100, 1, false },    // T = 1, hd 128
        { 2, 67, 16, 2, H100, 1, false },    // hd 8 (padded to 32)
        { 2, 67, 64, 2, H100, 1, true },     // hd 32, 2 tiles, the last one 3 rows
        { 2, 67, 128, 2, H100, 1, false },   // hd 64
        { 1, 130, 256, 2, H100, 1, true },   // hd 128, 3 tiles
        { 1, 130, 256, 2, 150000, 1, false },// hd 128: tiled forward, row-wise backward
        { 1, 130, 256, 2, 101376, 1, false },// hd 128: row-wise both ways
        { 2, 67, 96, 2, H100, 1, false },    // hd 48 (padded to 64)
        { 2, 67, 96, 2, 49152, 1, false },   // hd 48 on 48 KiB: row-wise
        { 3, 64, 48, 3, H100, 1, false },    // hd 16, T exactly one tile
        { 1, 129, 64, 1, 0, 1, true },       // no opt-in at all: every kernel row-wise
        { 2, 40, 320, 2, H100, 1, true },    // hd 160: the fallback
        { 1, 33, 200, 1, H100, 1, false },   // hd 200, one head
    };
    for (const att_case &c : cases)
        att_run(c);

    g_case = "attention arguments";
    float x[3 * 8] = { 0 };
    check_rc("NULL out", cuda_attention_forward(NULL, x, x, 1, 1, 8, 1), -EINVAL);
    check_rc("C % NH != 0", cuda_attention_forward(x, x, x, 1, 1, 8, 3), -EINVAL);
    check_rc("B = 0", cuda_attention_forward(x, x, x, 0, 1, 8, 1), -EINVAL);
    check_rc("backward without out", cuda_attention_backward(x, x, x, NULL, x, x, 1, 1, 8, 1),
             -EINVAL);
}

// ---- Attention in bf16 (cuda/attention_bf16.cu) ----

struct a16_case {
    int B, T, C, NH;
    int optin;    // the device's opt-in shared memory per block
    size_t off;   // every tensor at this float offset (1: not 16-byte aligned)
    bool det;     // also the determinism runs
    bool causal;  // also the exactness of the causal mask
    bool tc;      // the bf16 kernels must run (else the fp32 fallback)
    float ramp;   // > 0: scores that grow by about this much (natural log) along the sequence
};

// Columns [part·C, part·C + C) of a (rows, 3C) tensor.
std::vector<float> qkv_part(const std::vector<float> &x, size_t rows, int C, int part)
{
    std::vector<float> r(rows * (size_t)C);
    for (size_t i = 0; i < rows; i++)
        memcpy(&r[i * C], &x[i * 3 * (size_t)C + (size_t)part * C], (size_t)C * sizeof(float));
    return r;
}

void a16_run(const a16_case &a)
{
    const int B = a.B, T = a.T, C = a.C, NH = a.NH, hd = C / NH;
    const size_t rows = (size_t)B * T, nqkv = rows * 3 * C, nout = rows * C;
    const size_t nsv = (size_t)B * NH * T;
    char nm[192];
    snprintf(nm, sizeof nm, "attention bf16 B=%d T=%d C=%d NH=%d (hd %d)%s%s", B, T, C, NH, hd,
             a.optin != 232448 ? " optin=" : "", a.optin != 232448 ? std::to_string(a.optin).c_str() : "");
    if (a.off)
        snprintf(nm + strlen(nm), sizeof nm - strlen(nm), " at float offset %zu", a.off);
    if (a.ramp > 0)
        snprintf(nm + strlen(nm), sizeof nm - strlen(nm), " scores ramp up by %g", (double)a.ramp);
    g_case = nm;
    seed((uint64_t)(B * 1000003 + T * 1009 + C * 7 + NH) ^ 0xb16);
    emu_set_smem_optin(a.optin);
    // q and k in [-3, 3] (scores over e^±9), v and dout in [-1, 1].
    std::vector<float> qkv(nqkv), dout = rnd(nout, 1);
    for (size_t r = 0; r < rows; r++)
        for (int c = 0; c < 3 * C; c++)
            qkv[r * 3 * C + c] = urand(c < 2 * C ? 3.0f : 1.0f);
    if (a.ramp > 0) {
        // q in [0, 3], k small plus a part that grows with the position:
        // scale·q_i·k_j grows by about `ramp` from j = 0 to T, so a row's
        // max keeps rising tile after tile (the forward's rescaling; with a
        // steep ramp the factor exp2(m_old − m_new) underflows to 0).
        const double grow = a.ramp / (1.5 * hd / sqrt((double)hd));
        for (size_t r = 0; r < rows; r++)
            for (int c = 0; c < C; c++) {
                qkv[r * 3 * C + c] = fabsf(qkv[r * 3 * C + c]);
                qkv[r * 3 * C + C + c] =
                    urand(0.3f) + (float)(grow * (double)(r % (size_t)T) / T);
            }
    }

    Dev dev;
    float *d_qkv = dev.up(qkv, a.off), *d_dout = dev.up(dout, a.off);
    float *d_out = dev.alloc<float>(nout, a.off), *d_saved = dev.alloc<float>(nsv, a.off);
    float *d_scr = dev.alloc<float>(nsv, a.off), *d_dqkv = dev.alloc<float>(nqkv, a.off);
    check_rc("cuda_attention_forward_bf16",
             cuda_attention_forward_bf16(d_out, d_saved, d_qkv, B, T, C, NH), 0);
    std::vector<float> g_out = down(d_out, nout), g_saved = down(d_saved, nsv);
    char klog[1024];
    emu_kernel_log(klog, sizeof klog);
    check_rc("cuda_attention_backward_bf16",
             cuda_attention_backward_bf16(d_dqkv, d_scr, d_dout, d_out, d_qkv, d_saved, B, T, C, NH),
             0);
    std::vector<float> g_dqkv = down(d_dqkv, nqkv), g_scr = down(d_scr, nsv);
    char klog2[1024];
    emu_kernel_log(klog2, sizeof klog2);
    const bool f16 = strstr(klog, "a16_") != NULL, b16 = strstr(klog2, "a16_") != NULL;
    check_true(std::string(a.tc ? "the bf16 kernels ran" : "the fp32 kernels ran (fallback)") +
                   ", forward and backward alike: " + klog + "; " + klog2,
               f16 == a.tc && b16 == a.tc && (a.tc || (!strstr(klog, "a16_") && klog[0])));

    if (a.tc) {
        // The reference on the inputs rounded as the kernels round them.
        std::vector<float> qkv_r(nqkv), dout_r(nout);
        att_b16_round(qkv_r.data(), qkv.data(), nqkv);
        att_b16_round(dout_r.data(), dout.data(), nout);
        const size_t natt = (size_t)B * NH * T * T;
        std::vector<float> r_out(nout), r_att(natt), r_scr(natt), r_dqkv(nqkv);
        check_rc("expert_attention_forward (bf16-rounded inputs)",
                 expert_attention_forward(r_out.data(), r_att.data(), qkv_r.data(), B, T, C, NH), 0);
        check_rc("expert_attention_backward (bf16-rounded inputs)",
                 expert_attention_backward(r_dqkv.data(), r_scr.data(), dout_r.data(), qkv_r.data(),
                                           r_att.data(), B, T, C, NH),
                 0);
        std::vector<double> lse(nsv);
        std::vector<float> b_out(nout), b_lse(nsv), b_dqkv(nqkv), r_lse(nsv);
        if (att_b16_bounds(qkv_r.data(), dout_r.data(), g_out.data(), B, T, C, NH, lse.data(),
                           b_out.data(), b_lse.data(), b_dqkv.data()) != 0) {
            fprintf(stderr, "emu_test: out of memory\n");
            exit(1);
        }
        for (size_t i = 0; i < nsv; i++)
            r_lse[i] = (float)lse[i];
        const double atol = 1e-6;
        check_bound("out (bf16 bound)", g_out.data(), r_out.data(), b_out.data(), nout, atol);
        check_bound("saved log-sum-exp (fp32 bound)", g_saved.data(), r_lse.data(), b_lse.data(),
                    nsv, atol);
        static const char *part[3] = { "dq (bf16 bound)", "dk (bf16 bound)", "dv (bf16 bound)" };
        for (int p = 0; p < 3; p++) {
            std::vector<float> gp = qkv_part(g_dqkv, rows, C, p), rp = qkv_part(r_dqkv, rows, C, p),
                               bp = qkv_part(b_dqkv, rows, C, p);
            check_bound(part[p], gp.data(), rp.data(), bp.data(), nout, atol);
        }
        // D = rowsum(bf16(dout)·out), in scratch for the dK/dV kernel.
        std::vector<float> r_d(nsv);
        double dworst = 0;
        for (int b = 0; b < B; b++)
            for (int h = 0; h < NH; h++)
                for (int i = 0; i < T; i++) {
                    double sum = 0, mag = 0;
                    for (int d = 0; d < hd; d++) {
                        size_t x = ((size_t)b * T + i) * C + (size_t)h * hd + d;
                        sum += (double)dout_r[x] * g_out[x];
                        mag += fabs((double)dout_r[x] * g_out[x]);
                    }
                    size_t y = ((size_t)b * NH + h) * T + i;
                    double q = fabs(g_scr[y] - sum) / (4 * (hd + 8) * U32 * mag + 1e-30);
                    dworst = q > dworst ? q : dworst;
                }
        check_true("scratch holds D = Σ_d bf16(dout)·out (fp32 sum bound)", dworst <= 1);
    } else {
        // The fallback is the fp32 functions: their bits exactly.
        float *d_out2 = dev.alloc<float>(nout), *d_saved2 = dev.alloc<float>(nsv);
        float *d_scr2 = dev.alloc<float>(nsv), *d_dqkv2 = dev.alloc<float>(nqkv);
        check_rc("cuda_attention_forward", cuda_attention_forward(d_out2, d_saved2, d_qkv, B, T, C, NH),
                 0);
        check_rc("cuda_attention_backward",
                 cuda_attention_backward(d_dqkv2, d_scr2, d_dout, d_out2, d_qkv, d_saved2, B, T, C, NH),
                 0);
        check_bits("out = the fp32 path's", g_out.data(), down(d_out2, nout).data(), nout * 4);
        check_bits("saved = the fp32 path's", g_saved.data(), down(d_saved2, nsv).data(), nsv * 4);
        check_bits("dqkv = the fp32 path's", g_dqkv.data(), down(d_dqkv2, nqkv).data(), nqkv * 4);
        emu_kernel_log(klog, sizeof klog);
    }
    size_t nonfinite = 0;
    for (float x : g_dqkv)
        nonfinite += !isfinite(x);
    check_true("dqkv fully written (NaN-poisoned first): " + std::to_string(nonfinite) +
                   " non-finite",
               nonfinite == 0);

    if (a.det)
        deterministic("out, saved, dqkv, scratch", [&] {
            memset((void *)d_out, 0xFF, nout * 4);
            memset((void *)d_saved, 0xFF, nsv * 4);
            memset((void *)d_dqkv, 0xFF, nqkv * 4);
            memset((void *)d_scr, 0xFF, nsv * 4);
            cuda_attention_forward_bf16(d_out, d_saved, d_qkv, B, T, C, NH);
            cuda_attention_backward_bf16(d_dqkv, d_scr, d_dout, d_out, d_qkv, d_saved, B, T, C, NH);
            synced("attention bf16");
            std::vector<unsigned char> r = bytes_of(d_out, nout * 4);
            for (auto q : { bytes_of(d_saved, nsv * 4), bytes_of(d_dqkv, nqkv * 4),
                            bytes_of(d_scr, nsv * 4) })
                r.insert(r.end(), q.begin(), q.end());
            return r;
        });

    if (a.causal) {
        // Masked scores contribute exactly 0: new q, k and v for the last
        // position change no earlier row's out or lse, bit for bit.
        std::vector<float> q2 = qkv;
        for (int b = 0; b < B; b++)
            for (int c = 0; c < 3 * C; c++)
                q2[((size_t)b * T + T - 1) * 3 * C + c] = urand(c < 2 * C ? 30.0f : 100.0f);
        memcpy((void *)d_qkv, q2.data(), nqkv * 4);
        memset((void *)d_out, 0xFF, nout * 4);
        cuda_attention_forward_bf16(d_out, d_saved, d_qkv, B, T, C, NH);
        std::vector<float> o2 = down(d_out, nout), s2 = down(d_saved, nsv);
        size_t diff = 0, changed = 0;
        for (int b = 0; b < B; b++)
            for (int i = 0; i < T; i++)
                for (int c = 0; c < C; c++) {
                    size_t x = ((size_t)b * T + i) * C + c;
                    bool same = memcmp(&o2[x], &g_out[x], 4) == 0;
                    (i < T - 1 ? diff : changed) += !same;
                }
        for (size_t y = 0; y < nsv; y++)
            if (y % T != (size_t)T - 1)
                diff += memcmp(&s2[y], &g_saved[y], 4) != 0;
        check_true("causal mask exact: rows before T-1 the same bits after the last row's q, k, v "
                   "changed (" + std::to_string(diff) + " differ; the last row changed: " +
                   std::to_string(changed) + ")",
                   diff == 0 && changed > 0);
    }
    show_kernels();
    emu_set_smem_optin(232448);
}

void test_attention_bf16()
{
    const int H100 = 232448;
    const a16_case cases[] = {
        { 2, 1, 64, 2, H100, 0, true, false, true, 0 },      // T = 1, hd 32, B·NH 4
        { 1, 16, 128, 2, H100, 0, false, false, true, 0 },   // T = 16, hd 64 (one partial tile)
        { 2, 67, 64, 2, H100, 0, true, true, true, 0 },      // hd 32, 2 tiles, the last 3 rows
        { 1, 130, 256, 2, H100, 0, true, true, true, 0 },    // hd 128, 3 tiles
        { 1, 256, 128, 2, H100, 0, false, false, true, 0 },  // hd 64, 4 full tiles
        { 2, 67, 96, 2, H100, 0, false, false, true, 0 },    // hd 48 (padded to 64)
        { 3, 64, 48, 3, H100, 0, false, false, true, 0 },    // hd 16 (padded to 32), T one tile
        { 1, 67, 128, 2, H100, 1, false, false, true, 0 },   // hd 64, every tensor unaligned
        { 1, 33, 200, 1, H100, 0, false, false, false, 0 },  // hd 200: fp32
        { 2, 40, 80, 2, H100, 0, false, false, false, 0 },   // hd 40 (not a multiple of 16): fp32
        { 2, 67, 16, 2, H100, 0, false, false, false, 0 },   // hd 8: fp32
        { 1, 130, 256, 2, 101376, 0, false, false, false, 0 }, // hd 128, 99 KiB: the backward's
                                                            // 105 KiB do not fit, so neither runs bf16
        { 2, 67, 64, 2, 49152, 0, false, false, false, 0 },  // hd 32, no opt-in: the same
        { 1, 256, 128, 2, H100, 0, false, false, true, 60 },  // max rising (rescaling)
        { 2, 130, 64, 2, H100, 0, true, false, true, 400 },   // steep: alpha underflows to 0
    };
    for (const a16_case &c : cases)
        a16_run(c);

    g_case = "attention bf16 arguments";
    float x[3 * 8] = { 0 };
    check_rc("NULL out", cuda_attention_forward_bf16(NULL, x, x, 1, 1, 8, 1), -EINVAL);
    check_rc("C % NH != 0", cuda_attention_forward_bf16(x, x, x, 1, 1, 8, 3), -EINVAL);
    check_rc("T = 0", cuda_attention_forward_bf16(x, x, x, 1, 0, 8, 1), -EINVAL);
    check_rc("backward without saved",
             cuda_attention_backward_bf16(x, x, x, x, x, NULL, 1, 1, 8, 1), -EINVAL);
}

// ---- Embedding ----

void test_embedding()
{
    const int B = 4, T = 67, C = 50, V = 97, TMAX = 80;  // wpe longer than T
    const size_t n = (size_t)B * T, nout = n * C, nwte = (size_t)V * C, nwpe = (size_t)TMAX * C;
    g_case = "embedding B=4 T=67 C=50 V=97";
    seed(5);
    // Every other position is token 7, the rest random; token 0 and V-1 occur.
    std::vector<int32_t> tok(n);
    for (size_t i = 0; i < n; i++)
        tok[i] = i % 2 == 0 ? 7 : (int32_t)(rnd32() % V);
    tok[1] = 0;
    tok[3] = V - 1;
    std::vector<float> wte = rnd(nwte, 1), wpe = rnd(nwpe, 1), dout = rnd(nout, 1);
    std::vector<float> r_out(nout);
    check_rc("expert_embedding_forward",
             expert_embedding_forward(r_out.data(), tok.data(), wte.data(), wpe.data(), B, T, C, V), 0);
    Dev dev;
    float *d_wte = dev.up(wte), *d_wpe = dev.up(wpe), *d_out = dev.alloc<float>(nout);
    // tok is host memory (the contract): the op uploads it.
    check_rc("cuda_embedding_forward",
             cuda_embedding_forward(d_out, tok.data(), d_wte, d_wpe, B, T, C, V), 0);
    check_bits("out vs the CPU", down(d_out, nout).data(), r_out.data(), nout * 4);

    std::vector<float> g0te = rnd(nwte, 1), g0pe = rnd(nwpe, 1);
    std::vector<float> r_dwte = g0te, r_dwpe = g0pe;
    check_rc("expert_embedding_backward",
             expert_embedding_backward(r_dwte.data(), r_dwpe.data(), dout.data(), tok.data(), B, T, C, V),
             0);
    float *d_dout = dev.up(dout), *d_dwte = dev.up(g0te), *d_dwpe = dev.up(g0pe);
    check_rc("cuda_embedding_backward",
             cuda_embedding_backward(d_dwte, d_dwpe, d_dout, tok.data(), B, T, C, V), 0);
    // The same additions in the same order as the CPU (cuda/embedding.cu).
    check_bits("dwte (+=) vs the CPU", down(d_dwte, nwte).data(), r_dwte.data(), nwte * 4);
    check_bits("dwpe (+=) vs the CPU", down(d_dwpe, nwpe).data(), r_dwpe.data(), nwpe * 4);
    deterministic("out, dwte, dwpe", [&] {
        memcpy(d_dwte, g0te.data(), nwte * 4);
        memcpy(d_dwpe, g0pe.data(), nwpe * 4);
        cuda_embedding_forward(d_out, tok.data(), d_wte, d_wpe, B, T, C, V);
        cuda_embedding_backward(d_dwte, d_dwpe, d_dout, tok.data(), B, T, C, V);
        synced("embedding");
        std::vector<unsigned char> r = bytes_of(d_out, nout * 4), a = bytes_of(d_dwte, nwte * 4),
                                   b = bytes_of(d_dwpe, nwpe * 4);
        r.insert(r.end(), a.begin(), a.end());
        r.insert(r.end(), b.begin(), b.end());
        return r;
    });

    // Out of range: -EINVAL, nothing written.
    for (int which = 0; which < 2; which++) {
        std::vector<int32_t> bad = tok;
        if (which == 0)
            bad[n - 1] = V;
        else
            bad[0] = -1;
        std::string tag = which == 0 ? "token V at the end" : "token -1 at the start";
        memset(d_out, 0xFF, nout * 4);
        memcpy(d_dwte, g0te.data(), nwte * 4);
        memcpy(d_dwpe, g0pe.data(), nwpe * 4);
        check_rc("forward with " + tag,
                 cuda_embedding_forward(d_out, bad.data(), d_wte, d_wpe, B, T, C, V), -EINVAL);
        check_rc("backward with " + tag,
                 cuda_embedding_backward(d_dwte, d_dwpe, d_dout, bad.data(), B, T, C, V), -EINVAL);
        std::vector<float> o = down(d_out, nout);
        size_t touched = 0;
        for (float f : o)
            touched += !isnan(f);
        check_true("forward with " + tag + ": out untouched", touched == 0);
        check_bits("backward with " + tag + ": dwte unchanged", down(d_dwte, nwte).data(),
                   g0te.data(), nwte * 4);
        check_bits("backward with " + tag + ": dwpe unchanged", down(d_dwpe, nwpe).data(),
                   g0pe.data(), nwpe * 4);
    }

    // One token everywhere (one segment of B·T positions) and V = 1.
    g_case = "embedding V=1";
    std::vector<int32_t> zero(n, 0);
    std::vector<float> r1 = std::vector<float>(g0te.begin(), g0te.begin() + C), rp = g0pe;
    check_rc("expert_embedding_backward",
             expert_embedding_backward(r1.data(), rp.data(), dout.data(), zero.data(), B, T, C, 1), 0);
    memcpy(d_dwte, g0te.data(), (size_t)C * 4);
    memcpy(d_dwpe, g0pe.data(), nwpe * 4);
    check_rc("cuda_embedding_backward",
             cuda_embedding_backward(d_dwte, d_dwpe, d_dout, zero.data(), B, T, C, 1), 0);
    check_bits("dwte vs the CPU", down(d_dwte, C).data(), r1.data(), (size_t)C * 4);
    check_bits("dwpe vs the CPU", down(d_dwpe, nwpe).data(), rp.data(), nwpe * 4);
    show_kernels();
}

// ---- Softmax ----

void test_softmax()
{
    const struct {
        int N, V;
        float scale;
    } cases[] = { { 37, 300, 5 }, { 5, 1, 1 }, { 3, 33, 1 }, { 64, 1000, 30 }, { 9, 64, 3 } };
    for (const auto &c : cases) {
        const int N = c.N, V = c.V;
        const size_t n = (size_t)N * V;
        char nm[96];
        snprintf(nm, sizeof nm, "softmax N=%d V=%d ±%g", N, V, (double)c.scale);
        g_case = nm;
        seed((uint64_t)(N * 7919 + V));
        std::vector<float> x = rnd(n, c.scale), dy = rnd(n, 1), r_y(n), r_dx(n);
        check_rc("expert_softmax_forward", expert_softmax_forward(r_y.data(), x.data(), N, V), 0);
        check_rc("expert_softmax_backward",
                 expert_softmax_backward(r_dx.data(), dy.data(), r_y.data(), N, V), 0);
        Dev dev;
        float *d_x = dev.up(x), *d_y = dev.alloc<float>(n);
        check_rc("cuda_softmax_forward", cuda_softmax_forward(d_y, d_x, N, V), 0);
        std::vector<float> y = down(d_y, n);
        check_close("out", y.data(), r_y.data(), n, 1e-7, 1e-5);
        check_rc("cuda_softmax_forward in place", cuda_softmax_forward(d_x, d_x, N, V), 0);
        check_bits("out (aliases inp) = out", down(d_x, n).data(), y.data(), n * 4);
        // The backward from the CPU's probabilities, so only it differs.
        float *d_ry = dev.up(r_y), *d_dy = dev.up(dy), *d_dx = dev.alloc<float>(n);
        check_rc("cuda_softmax_backward", cuda_softmax_backward(d_dx, d_dy, d_ry, N, V), 0);
        std::vector<float> dx = down(d_dx, n);
        check_close("dinp", dx.data(), r_dx.data(), n, 1e-6, 1e-5);
        check_rc("cuda_softmax_backward in place", cuda_softmax_backward(d_dy, d_dy, d_ry, N, V), 0);
        check_bits("dinp (aliases dout) = dinp", down(d_dy, n).data(), dx.data(), n * 4);
        if (N > 8)
            deterministic("out, dinp", [&] {
                memcpy(d_x, x.data(), n * 4);
                memcpy(d_dy, dy.data(), n * 4);
                cuda_softmax_forward(d_y, d_x, N, V);
                cuda_softmax_backward(d_dx, d_dy, d_ry, N, V);
                synced("softmax");
                std::vector<unsigned char> r = bytes_of(d_y, n * 4), a = bytes_of(d_dx, n * 4);
                r.insert(r.end(), a.begin(), a.end());
                return r;
            });
        show_kernels();
    }
    g_case = "softmax arguments";
    check_rc("NULL", cuda_softmax_forward(NULL, NULL, 0, 1), -EINVAL);
    Dev dev;
    float *d = dev.alloc<float>(1);
    check_rc("N = 0", cuda_softmax_forward(d, d, 0, 1), 0);
    check_rc("N = 0 backward", cuda_softmax_backward(d, d, d, 0, 1), 0);
}

// ---- LayerNorm ----

void test_layernorm()
{
    const struct {
        int N, C;
        float shift;
    } cases[] = { { 37, 300, 5 }, { 600, 70, 1 }, { 3, 1, 0 }, { 9, 33, -2 } };
    for (const auto &c : cases) {
        const int N = c.N, C = c.C;
        const size_t n = (size_t)N * C;
        char nm[96];
        snprintf(nm, sizeof nm, "layernorm N=%d C=%d", N, C);
        g_case = nm;
        seed((uint64_t)(N * 131 + C));
        std::vector<float> x = rnd(n, 3), w = rnd(C, 1), b = rnd(C, 1), dy = rnd(n, 1);
        for (auto &v : x)
            v += c.shift;  // a large mean, as residual streams have
        std::vector<float> dw0 = rnd(C, 1), db0 = rnd(C, 1);
        std::vector<float> r_y(n), r_m(N), r_r(N), r_dx(n), r_dw = dw0, r_db = db0;
        check_rc("expert_layernorm_forward",
                 expert_layernorm_forward(r_y.data(), r_m.data(), r_r.data(), x.data(), w.data(),
                                          b.data(), N, C),
                 0);
        check_rc("expert_layernorm_backward",
                 expert_layernorm_backward(r_dx.data(), r_dw.data(), r_db.data(), dy.data(), x.data(),
                                           w.data(), r_m.data(), r_r.data(), N, C),
                 0);
        Dev dev;
        float *d_x = dev.up(x), *d_w = dev.up(w), *d_b = dev.up(b), *d_dy = dev.up(dy);
        float *d_y = dev.alloc<float>(n), *d_m = dev.alloc<float>(N), *d_r = dev.alloc<float>(N);
        float *d_dx = dev.alloc<float>(n), *d_dw = dev.up(dw0), *d_db = dev.up(db0);
        check_rc("cuda_layernorm_forward",
                 cuda_layernorm_forward(d_y, d_m, d_r, d_x, d_w, d_b, N, C), 0);
        std::vector<float> y = down(d_y, n);
        check_close("out", y.data(), r_y.data(), n, 1e-4, 1e-4);
        check_close("mean", down(d_m, N).data(), r_m.data(), N, 1e-5, 1e-5);
        check_close("rstd", down(d_r, N).data(), r_r.data(), N, 1e-5, 1e-4);
        float *d_y2 = dev.alloc<float>(n);
        check_rc("forward without mean and rstd",
                 cuda_layernorm_forward(d_y2, NULL, NULL, d_x, d_w, d_b, N, C), 0);
        check_bits("out without mean and rstd = out", down(d_y2, n).data(), y.data(), n * 4);
        check_rc("cuda_layernorm_backward",
                 cuda_layernorm_backward(d_dx, d_dw, d_db, d_dy, d_x, d_w, d_m, d_r, N, C), 0);
        std::vector<float> dx = down(d_dx, n), dw = down(d_dw, C), db = down(d_db, C);
        // The backward from the GPU's mean and rstd (rounded as the CPU's, or nearly).
        check_close("dinp", dx.data(), r_dx.data(), n, 1e-4, 1e-3);
        check_close("dw (+=)", dw.data(), r_dw.data(), C, 1e-4, 1e-3);
        check_close("db (+=)", db.data(), r_db.data(), C, 1e-4, 1e-4);
        // dinp aliasing dout: the same bits.
        float *d_dy2 = dev.up(dy), *d_dw2 = dev.up(dw0), *d_db2 = dev.up(db0);
        check_rc("backward in place",
                 cuda_layernorm_backward(d_dy2, d_dw2, d_db2, d_dy2, d_x, d_w, d_m, d_r, N, C), 0);
        check_bits("dinp (aliases dout) = dinp", down(d_dy2, n).data(), dx.data(), n * 4);
        check_bits("dw with dinp aliasing dout = dw", down(d_dw2, C).data(), dw.data(), (size_t)C * 4);
        check_bits("db with dinp aliasing dout = db", down(d_db2, C).data(), db.data(), (size_t)C * 4);
        if (N > 8)
            deterministic("out, mean, rstd, dinp, dw, db", [&] {
                memcpy(d_dw, dw0.data(), (size_t)C * 4);
                memcpy(d_db, db0.data(), (size_t)C * 4);
                cuda_layernorm_forward(d_y, d_m, d_r, d_x, d_w, d_b, N, C);
                cuda_layernorm_backward(d_dx, d_dw, d_db, d_dy, d_x, d_w, d_m, d_r, N, C);
                synced("layernorm");
                std::vector<unsigned char> r = bytes_of(d_y, n * 4);
                for (auto q : { bytes_of(d_m, (size_t)N * 4), bytes_of(d_r, (size_t)N * 4),
                                bytes_of(d_dx, n * 4), bytes_of(d_dw, (size_t)C * 4),
                                bytes_of(d_db, (size_t)C * 4) })
                    r.insert(r.end(), q.begin(), q.end());
                return r;
            });
        show_kernels();
    }
}

// ---- Bias, GELU, residual ----

// dst[c] + Σ_b src[b][c] in cuda__colsum_add's order: chunks of 256 rows
// summed in row order, then the chunks' sums in chunk order, then added.
std::vector<float> colsum_order(const std::vector<float> &dst, const std::vector<float> &src, int B,
                                int C)
{
    std::vector<float> r(C);
    for (int c = 0; c < C; c++) {
        float tot = 0.0f;
        for (int k = 0; k * 256 < B; k++) {
            float a = 0.0f;
            for (int row = k * 256; row < B && row < k * 256 + 256; row++)
                a += src[(size_t)row * C + c];
            tot += a;
        }
        r[c] = dst[c] + tot;
    }
    return r;
}

void test_bias()
{
    {
        const int B = 19, C = 300;
        const size_t n = (size_t)B * C;
        g_case = "bias forward B=19 C=300";
        seed(11);
        std::vector<float> x = rnd(n, 4), bias = rnd(C, 1), r(n);
        check_rc("expert_bias_forward", expert_bias_forward(r.data(), x.data(), bias.data(), B, C), 0);
        Dev dev;
        float *d_x = dev.up(x), *d_b = dev.up(bias), *d_o = dev.alloc<float>(n);
        check_rc("cuda_bias_forward", cuda_bias_forward(d_o, d_x, d_b, B, C), 0);
        check_bits("out vs the CPU (one add)", down(d_o, n).data(), r.data(), n * 4);
        check_rc("in place", cuda_bias_forward(d_x, d_x, d_b, B, C), 0);
        check_bits("out (aliases inp) vs the CPU", down(d_x, n).data(), r.data(), n * 4);
        show_kernels();
    }
    const int Bs[] = { 1, 255, 256, 257, 700 };
    for (int B : Bs) {
        const int C = 300;  // two blocks of columns, the second partly idle
        const size_t n = (size_t)B * C;
        g_case = "bias backward B=" + std::to_string(B) + " C=300";
        seed((uint64_t)B);
        std::vector<float> d = rnd(n, 1), db0 = rnd(C, 1), r = db0;
        check_rc("expert_bias_backward", expert_bias_backward(r.data(), d.data(), B, C), 0);
        Dev dev;
        float *d_d = dev.up(d), *d_db = dev.up(db0);
        check_rc("cuda_bias_backward", cuda_bias_backward(d_db, d_d, B, C), 0);
        std::vector<float> got = down(d_db, C), order = colsum_order(db0, d, B, C);
        check_bits("dbias (+=) in the documented order", got.data(), order.data(), (size_t)C * 4);
        check_close("dbias (+=) vs the CPU", got.data(), r.data(), C, 1e-4, 1e-4);
        if (B > 256)
            deterministic("dbias", [&] {
                memcpy(d_db, db0.data(), (size_t)C * 4);
                cuda_bias_backward(d_db, d_d, B, C);
                synced("bias");
                return bytes_of(d_db, (size_t)C * 4);
            });
        show_kernels();
    }
    g_case = "bias arguments";
    Dev dev;
    float *d = dev.up(std::vector<float>(4, 1.0f));
    check_rc("B = 0", cuda_bias_backward(d, d, 0, 4), 0);
    check_bits("B = 0 changes nothing", down(d, 4).data(), std::vector<float>(4, 1.0f).data(), 16);
    check_rc("C = 0", cuda_bias_forward(d, d, d, 1, 0), -EINVAL);
}

void test_gelu()
{
    const int B = 19, C = 130;
    const size_t n = (size_t)B * C;
    g_case = "gelu n=2470";
    seed(13);
    std::vector<float> x = rnd(n, 4), bias = rnd(C, 1), dy = rnd(n, 1), r_y(n), r_dx(n);
    check_rc("expert_gelu_forward", expert_gelu_forward(r_y.data(), x.data(), (long)n), 0);
    check_rc("expert_gelu_backward", expert_gelu_backward(r_dx.data(), dy.data(), x.data(), (long)n), 0);
    Dev dev;
    float *d_x = dev.up(x), *d_dy = dev.up(dy), *d_y = dev.alloc<float>(n), *d_dx = dev.alloc<float>(n);
    check_rc("cuda_gelu_forward", cuda_gelu_forward(d_y, d_x, (long)n), 0);
    check_rc("cuda_gelu_backward", cuda_gelu_backward(d_dx, d_dy, d_x, (long)n), 0);
    check_close("out", down(d_y, n).data(), r_y.data(), n, 1e-5, 1e-5);
    check_close("dinp", down(d_dx, n).data(), r_dx.data(), n, 1e-5, 1e-4);
    show_kernels();

    g_case = "bias_gelu B=19 C=130";
    std::vector<float> pre = x, out(n), dg(n), dpre(n), dbias0 = rnd(C, 1), dbias = dbias0;
    check_rc("expert_bias_gelu_forward",
             expert_bias_gelu_forward(out.data(), dg.data(), pre.data(), bias.data(), B, C), 0);
    check_rc("expert_bias_gelu_backward",
             expert_bias_gelu_backward(dpre.data(), dbias.data(), dy.data(), dg.data(), B, C), 0);
    float *d_pre = dev.up(x), *d_bias = dev.up(bias), *d_out = dev.alloc<float>(n);
    float *d_dg = dev.alloc<float>(n), *d_dpre = dev.alloc<float>(n), *d_dbias = dev.up(dbias0);
    check_rc("cuda_bias_gelu_forward", cuda_bias_gelu_forward(d_out, d_dg, d_pre, d_bias, B, C), 0);
    std::vector<float> g_out = down(d_out, n), g_dg = down(d_dg, n), g_pre = down(d_pre, n);
    check_bits("pre (+= bias, one add) vs the CPU", g_pre.data(), pre.data(), n * 4);
    check_close("out", g_out.data(), out.data(), n, 1e-5, 1e-5);
    check_close("dgelu", g_dg.data(), dg.data(), n, 1e-5, 1e-4);
    float *d_pre2 = dev.up(x), *d_out2 = dev.alloc<float>(n);
    check_rc("forward without dgelu", cuda_bias_gelu_forward(d_out2, NULL, d_pre2, d_bias, B, C), 0);
    check_bits("out without dgelu = out", down(d_out2, n).data(), g_out.data(), n * 4);
    // The backward from the CPU's dgelu: dpre is one product, as on the CPU.
    float *d_rdg = dev.up(dg);
    check_rc("cuda_bias_gelu_backward", cuda_bias_gelu_backward(d_dpre, d_dbias, d_dy, d_rdg, B, C), 0);
    std::vector<float> g_dpre = down(d_dpre, n), g_db = down(d_dbias, C);
    check_bits("dpre vs the CPU (one product)", g_dpre.data(), dpre.data(), n * 4);
    check_bits("dbias (+=) in the documented order", g_db.data(),
               colsum_order(dbias0, dpre, B, C).data(), (size_t)C * 4);
    check_close("dbias (+=) vs the CPU", g_db.data(), dbias.data(), C, 1e-4, 1e-4);
    float *d_dy2 = dev.up(dy), *d_dbias2 = dev.up(dbias0);
    check_rc("backward in place", cuda_bias_gelu_backward(d_dy2, d_dbias2, d_dy2, d_rdg, B, C), 0);
    check_bits("dpre (aliases dout) = dpre", down(d_dy2, n).data(), g_dpre.data(), n * 4);
    check_bits("dbias with dpre aliasing dout = dbias", down(d_dbias2, C).data(), g_db.data(),
               (size_t)C * 4);
    deterministic("gelu and bias_gelu outputs", [&] {
        memcpy(d_pre, x.data(), n * 4);
        memcpy(d_dbias, dbias0.data(), (size_t)C * 4);
        cuda_gelu_forward(d_y, d_x, (long)n);
        cuda_gelu_backward(d_dx, d_dy, d_x, (long)n);
        cuda_bias_gelu_forward(d_out, d_dg, d_pre, d_bias, B, C);
        cuda_bias_gelu_backward(d_dpre, d_dbias, d_dy, d_rdg, B, C);
        synced("gelu");
        std::vector<unsigned char> r = bytes_of(d_y, n * 4);
        for (auto q : { bytes_of(d_dx, n * 4), bytes_of(d_out, n * 4), bytes_of(d_dg, n * 4),
                        bytes_of(d_pre, n * 4), bytes_of(d_dpre, n * 4),
                        bytes_of(d_dbias, (size_t)C * 4) })
            r.insert(r.end(), q.begin(), q.end());
        return r;
    });
    show_kernels();
}

void test_residual()
{
    const size_t n = 70001;  // several blocks, the last one partly idle
    g_case = "residual n=70001";
    seed(17);
    std::vector<float> a = rnd(n, 1), b = rnd(n, 1), dout = rnd(n, 1), r(n);
    check_rc("expert_residual_forward", expert_residual_forward(r.data(), a.data(), b.data(), (long)n), 0);
    Dev dev;
    float *d_a = dev.up(a), *d_b = dev.up(b), *d_o = dev.alloc<float>(n), *d_dout = dev.up(dout);
    check_rc("cuda_residual_forward", cuda_residual_forward(d_o, d_a, d_b, (long)n), 0);
    check_bits("out vs the CPU (one add)", down(d_o, n).data(), r.data(), n * 4);
    check_rc("in place", cuda_residual_forward(d_a, d_a, d_b, (long)n), 0);
    check_bits("out (aliases a) vs the CPU", down(d_a, n).data(), r.data(), n * 4);
    float *d_da = dev.alloc<float>(n), *d_db = dev.alloc<float>(n);
    check_rc("cuda_residual_backward", cuda_residual_backward(d_da, d_db, d_dout, (long)n), 0);
    check_bits("da = dout", down(d_da, n).data(), dout.data(), n * 4);
    check_bits("db = dout", down(d_db, n).data(), dout.data(), n * 4);
    check_rc("da NULL, db aliases dout", cuda_residual_backward(NULL, d_dout, d_dout, (long)n), 0);
    check_bits("dout unchanged", down(d_dout, n).data(), dout.data(), n * 4);
    check_rc("N = 0", cuda_residual_forward(d_o, d_a, d_b, 0), 0);
    deterministic("out", [&] {
        cuda_residual_forward(d_o, d_dout, d_b, (long)n);
        synced("residual");
        return bytes_of(d_o, n * 4);
    });
    show_kernels();
}

// ---- Cross-entropy ----

void test_crossentropy()
{
    const struct {
        int B, V;
    } cases[] = { { 37, 10 }, { 9, 1000 }, { 3, 1 }, { 64, 33 } };
    for (const auto &c : cases) {
        const int B = c.B, V = c.V;
        const size_t n = (size_t)B * V;
        char nm[96];
        snprintf(nm, sizeof nm, "crossentropy B=%d V=%d", B, V);
        g_case = nm;
        seed((uint64_t)(B * 3 + V));
        std::vector<float> z = rnd(n, 6), loss(B), p(n), dz(n);
        std::vector<int32_t> t(B);
        for (auto &v : t)
            v = (int32_t)(rnd32() % (unsigned)V);
        check_rc("expert_crossentropy_forward",
                 expert_crossentropy_forward(loss.data(), p.data(), z.data(), t.data(), B, V), 0);
        Dev dev;
        float *d_z = dev.up(z), *d_l = dev.alloc<float>(B), *d_p = dev.alloc<float>(n);
        float *d_dz = dev.alloc<float>(n);
        int32_t *d_t = dev.up(t);
        check_rc("cuda_crossentropy_forward", cuda_crossentropy_forward(d_l, d_p, d_z, d_t, B, V), 0);
        std::vector<float> g_p = down(d_p, n);
        check_close("losses", down(d_l, B).data(), loss.data(), B, 1e-5, 1e-5);
        check_close("probs", g_p.data(), p.data(), n, 1e-6, 1e-5);
        // The backward on the GPU's probabilities, on both: the same float ops.
        check_rc("expert_crossentropy_backward",
                 expert_crossentropy_backward(dz.data(), g_p.data(), t.data(), 1.0f / B, B, V), 0);
        check_rc("cuda_crossentropy_backward",
                 cuda_crossentropy_backward(d_dz, d_p, d_t, 1.0f / B, B, V), 0);
        check_bits("dlogits vs the CPU", down(d_dz, n).data(), dz.data(), n * 4);
        if (B > 8)
            deterministic("losses, probs, dlogits", [&] {
                cuda_crossentropy_forward(d_l, d_p, d_z, d_t, B, V);
                cuda_crossentropy_backward(d_dz, d_p, d_t, 1.0f / B, B, V);
                synced("crossentropy");
                std::vector<unsigned char> r = bytes_of(d_l, (size_t)B * 4), a = bytes_of(d_p, n * 4),
                                           b = bytes_of(d_dz, n * 4);
                r.insert(r.end(), a.begin(), a.end());
                r.insert(r.end(), b.begin(), b.end());
                return r;
            });
        // An out-of-range target: -EINVAL, as on the CPU, and nothing
        // written (the outputs keep what the last good call left).
        std::vector<unsigned char> l0 = bytes_of(d_l, (size_t)B * 4), p0 = bytes_of(d_p, n * 4),
                                   dz0 = bytes_of(d_dz, n * 4);
        for (int bad : { V, -1 }) {
            std::vector<int32_t> tb = t;
            tb[B / 2] = bad;
            memcpy(d_t, tb.data(), (size_t)B * 4);
            check_rc("target " + std::to_string(bad) + ": forward -EINVAL",
                     cuda_crossentropy_forward(d_l, d_p, d_z, d_t, B, V), -EINVAL);
            check_rc("target " + std::to_string(bad) + ": backward -EINVAL",
                     cuda_crossentropy_backward(d_dz, d_p, d_t, 1.0f / B, B, V), -EINVAL);
            synced("crossentropy, bad target");
            check_bits("losses untouched", bytes_of(d_l, (size_t)B * 4).data(), l0.data(), l0.size());
            check_bits("probs untouched", bytes_of(d_p, n * 4).data(), p0.data(), p0.size());
            check_bits("dlogits untouched", bytes_of(d_dz, n * 4).data(), dz0.data(), dz0.size());
        }
        show_kernels();
    }
}

// ---- No device ----

void test_no_device()
{
    g_case = "no device";
    emu_ctx_set_no_device(1);
    float x[64] = { 0 };
    int32_t t[4] = { 0 };
    uint16_t h[4];
    double d = 0, s[2] = { 0, 0 };
    struct expert_optim o;
    expert_optim_default_adamw(&o);
    const int E = -ENODEV;
    check_rc("bias_forward", cuda_bias_forward(x, x, x, 1, 1), E);
    check_rc("bias_backward", cuda_bias_backward(x, x, 1, 1), E);
    check_rc("layernorm_forward", cuda_layernorm_forward(x, x, x, x, x, x, 1, 1), E);
    check_rc("layernorm_backward", cuda_layernorm_backward(x, x, x, x, x, x, x, x, 1, 1), E);
    check_rc("gelu_forward", cuda_gelu_forward(x, x, 1), E);
    check_rc("gelu_backward", cuda_gelu_backward(x, x, x, 1), E);
    check_rc("bias_gelu_forward", cuda_bias_gelu_forward(x, x, x, x, 1, 1), E);
    check_rc("bias_gelu_backward", cuda_bias_gelu_backward(x, x, x, x, 1, 1), E);
    check_rc("residual_forward", cuda_residual_forward(x, x, x, 1), E);
    check_rc("residual_backward", cuda_residual_backward(x, x, x, 1), E);
    check_rc("crossentropy_forward", cuda_crossentropy_forward(x, x, x, t, 1, 1), E);
    check_rc("crossentropy_backward", cuda_crossentropy_backward(x, x, t, 1, 1, 1), E);
    check_rc("softmax_forward", cuda_softmax_forward(x, x, 1, 1), E);
    check_rc("softmax_backward", cuda_softmax_backward(x, x, x, 1, 1), E);
    check_rc("attention_forward", cuda_attention_forward(x, x, x, 1, 1, 8, 1), E);
    check_rc("attention_backward", cuda_attention_backward(x, x, x, x, x, x, 1, 1, 8, 1), E);
    check_rc("attention_forward_bf16", cuda_attention_forward_bf16(x, x, x, 1, 1, 16, 1), E);
    check_rc("attention_backward_bf16", cuda_attention_backward_bf16(x, x, x, x, x, x, 1, 1, 16, 1), E);
    check_rc("embedding_forward", cuda_embedding_forward(x, t, x, x, 1, 1, 1, 1), E);
    check_rc("embedding_backward", cuda_embedding_backward(x, x, x, t, 1, 1, 1, 1), E);
    check_rc("sqnorm", cuda_sqnorm(&d, x, 1), E);
    check_rc("adamw_update", cuda_adamw_update(x, x + 8, x + 16, x + 24, x + 32, 1, 1, &o, 1, s), E);
    expert_optim_default_sgd(&o);
    check_rc("sgd_update", cuda_sgd_update(x, x + 8, x + 16, x + 24, 1, 1, &o, s), E);
    check_rc("cast_bf16", cuda_cast_bf16(h, x, 1), E);
    emu_ctx_set_no_device(0);
    check_true("nothing was queued", emu_sync() == cudaSuccess && emu_get_stats().launches >= 0);
}

double now()
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

}  // namespace

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    g_verbose = argc > 1 && strcmp(argv[1], "-v") == 0;
    const double t0 = now();
    int sf = emu_selftest();
    char klog[2048];
    emu_kernel_log(klog, sizeof klog);
    g_checks += 1;
    g_fails += sf != 0;
    printf("%s the emulator's self-test (%d failure(s))\n", sf ? "FAIL" : "ok  ", sf);

    const struct {
        const char *name;
        void (*fn)(void);
    } suites[] = {
        { "step (sqnorm, adamw, sgd)", test_step }, { "cast_bf16", test_cast },
        { "attention", test_attention },             { "attention bf16", test_attention_bf16 },
        { "embedding", test_embedding },
        { "softmax", test_softmax },                 { "layernorm", test_layernorm },
        { "bias", test_bias },                       { "gelu", test_gelu },
        { "residual", test_residual },               { "crossentropy", test_crossentropy },
        { "no device", test_no_device },
    };
    for (const auto &s : suites) {
        int f0 = g_fails, c0 = g_checks;
        double t = now();
        s.fn();
        printf("%s %-26s %4d checks, %d failed, %6.2f s\n", g_fails == f0 ? "ok  " : "FAIL", s.name,
               g_checks - c0, g_fails - f0, now() - t);
    }
    emu_stats st = emu_get_stats();
    printf("%d checks, %d failed; %.1f s; emulated %ld launches, %ld blocks, %ld CUDA threads, %ld "
           "fiber switches\n",
           g_checks, g_fails, now() - t0, st.launches, st.blocks, st.threads, st.switches);
    return g_fails ? 1 : 0;
}
