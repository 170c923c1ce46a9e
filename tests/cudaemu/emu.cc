// tests/cudaemu/emu.cc: the emulator's runtime (see emu.h): fibers, the
// block scheduler, barriers and warp ops, shared and device memory, streams.
//
// Fibers. Each CUDA thread of a block runs on a stack of its own, entered
// once with makecontext/setcontext; after that, switches are GCC's
// __builtin_setjmp/__builtin_longjmp (they save only what the compiler
// needs, call nothing, and are not intercepted by AddressSanitizer, whose
// longjmp interceptor makes a system call per switch). Under ASan every
// switch is announced with __sanitizer_start_switch_fiber /
// __sanitizer_finish_switch_fiber, and a stack is unpoisoned before a fiber
// is made afresh on it.
#include "emu.h"

#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <deque>
#include <map>
#include <mutex>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define EMU_ASAN 1
#endif
#endif
#ifdef EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define ASAN_START(save, bottom, size) __sanitizer_start_switch_fiber((save), (bottom), (size))
#define ASAN_FINISH(save, bottom, size) __sanitizer_finish_switch_fiber((save), (bottom), (size))
#define ASAN_UNPOISON(p, n) __asan_unpoison_memory_region((p), (n))
#else
#define ASAN_START(save, bottom, size) ((void)(save), (void)(bottom), (void)(size))
#define ASAN_FINISH(save, bottom, size) ((void)(save), (void)(bottom), (void)(size))
#define ASAN_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

namespace {

const int MAX_THREADS = 1024;
const int WARP = 32;
const size_t DEFAULT_SMEM = 48 * 1024;       // without cudaFuncSetAttribute
const size_t STATIC_SMEM = 48 * 1024;        // the most static shared memory a block has
const size_t SMEM_MAP = 1024 * 1024;         // room for any opt-in
const size_t GUARD = 64;                     // guard bytes after shared arrays
const size_t LEAD = 256;                     // guard bytes before dynamic shared memory
const size_t DYN_ALIGN = 128;                // alignment of dynamic shared memory
const uint32_t SENTINEL = 0x5e7e11e5u;       // what guard bytes hold
const size_t STACK = 256 * 1024;

size_t page_size() { return (size_t)sysconf(_SC_PAGESIZE); }
size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

void fill32(void *p, size_t bytes, uint32_t w)
{
    unsigned char *b = (unsigned char *)p;
    size_t i = 0;
    for (; i + 4 <= bytes; i += 4)
        memcpy(b + i, &w, 4);
    for (; i < bytes; i++)
        b[i] = (unsigned char)(w >> (8 * (i % 4)));
}

// The first byte of [p, p + bytes) that differs from fill32's pattern w
// (starting at p), or -1.
long check32(const void *p, size_t bytes, uint32_t w)
{
    const unsigned char *b = (const unsigned char *)p;
    for (size_t i = 0; i < bytes; i++)
        if (b[i] != (unsigned char)(w >> (8 * (i % 4))))
            return (long)i;
    return -1;
}

// A mapping [guard page][len bytes, rounded up to pages][guard page]; returns
// its start (the first guard page).
char *map_guarded(size_t len, size_t *map_len)
{
    size_t pg = page_size();
    len = round_up(len, pg);
    char *m = (char *)mmap(NULL, len + 2 * pg, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED)
        return NULL;
    mprotect(m, pg, PROT_NONE);
    mprotect(m + pg + len, pg, PROT_NONE);
    *map_len = len + 2 * pg;
    return m;
}

// ---- Fibers ----

// A context for __builtin_setjmp: frame pointer, resume address, stack
// pointer (and room to spare).
typedef void *jbuf[5];

// __builtin_longjmp may not be in the function that calls __builtin_setjmp.
// Neither noreturn nor instrumented: ASan would put a call to
// __asan_handle_no_return (a system call, and a memset of the stack's
// shadow) before every switch; the switches are announced instead.
__attribute__((noinline, no_sanitize_address)) void jump(void **b)
{
    __builtin_longjmp(b, 1);
}

enum { F_NEW, F_READY, F_WAIT, F_DONE };

struct fiber {
    jbuf jb;
    char *map;
    size_t map_len;
    char *stack;
    size_t stack_len;
    void *fake_stack;  // ASan's
    uint3 tid;
    int index, lane, warp;
    int state;
    int startable;     // parked at the top of a body (fresh, or after one ended)
    int wait_kind;     // -1: __syncthreads, else an emu_warp_kind
    const char *wait_what;  // what it waits in (the wmma call's name for a collective)
    const char *wait_file;
    int wait_line;
};

fiber *g_fib[MAX_THREADS];
fiber *g_cur;               // NULL on the host
jbuf g_main_jb;
void *g_main_fake;
const void *g_main_bottom;
size_t g_main_size;
jbuf g_create_jb;
bool g_from_host;           // the last switch left the host's context
fiber *g_creating;
emu_launch_base *g_launch;  // the launch running
uint3 g_host_tid;

struct group {
    unsigned mask, arrived;
    int kind;
    const char *file;
    int line;
    const char *what;  // the op's name (a collective's own)
};

struct warp_state {
    unsigned exists, live;
    group g[WARP];
    int ngroups;
    uint64_t val[WARP], res[WARP];
    int b[WARP], c[WARP];
    // A collective: the first lane's argument bytes, every lane's data.
    unsigned char cargs[EMU_COLLECTIVE_ARGS];
    size_t clen;
    void *cdata[WARP];
};

struct block_state {
    int n, live;
    int ring[MAX_THREADS], head, count;
    int bar_count, bar_wait[MAX_THREADS];
    const char *bar_file;
    int bar_line;
    int nwarps;
    warp_state warp[MAX_THREADS / WARP];
    bool fault;
};
block_state B;
bool g_in_block;            // between a block's start and its end

// ---- Scheduling policy ----

int g_order = EMU_ORDER_FORWARD;
uint64_t g_rng = 0x9e3779b97f4a7c15ull;

uint64_t rnd()
{
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return g_rng;
}

void order(int *v, int n)
{
    if (g_order == EMU_ORDER_FORWARD)
        std::sort(v, v + n);
    else if (g_order == EMU_ORDER_REVERSE)
        std::sort(v, v + n, [](int a, int b) { return a > b; });
    else
        for (int i = n - 1; i > 0; i--)
            std::swap(v[i], v[rnd() % (uint64_t)(i + 1)]);
}

// ---- Errors ----

cudaError_t g_last = cudaSuccess;    // cudaGetLastError's
cudaError_t g_sticky = cudaSuccess;  // a fault in a kernel: every later call fails
std::string g_fault;
int g_fault_print = 1;
emu_stats g_stats;
std::vector<std::string> g_klog;
std::recursive_mutex g_mu;

cudaError_t set_last(cudaError_t e)
{
    if (e != cudaSuccess)
        g_last = e;
    return e;
}

std::string where()
{
    char buf[512];
    if (!g_launch)
        return "";
    const emu_launch_base *l = g_launch;
    int n = snprintf(buf, sizeof buf,
                     "kernel %s (launched at %s:%d, grid (%u,%u,%u), block (%u,%u,%u), %zu bytes "
                     "of dynamic shared memory)",
                     l->name, l->file, l->line, l->grid.x, l->grid.y, l->grid.z, l->block.x,
                     l->block.y, l->block.z, l->smem);
    if (g_in_block && n > 0 && (size_t)n < sizeof buf)
        n += snprintf(buf + n, sizeof buf - (size_t)n, ", block (%u,%u,%u)", emu_block_idx.x,
                      emu_block_idx.y, emu_block_idx.z);
    if (g_cur && n > 0 && (size_t)n < sizeof buf)
        snprintf(buf + n, sizeof buf - (size_t)n, ", thread (%u,%u,%u)", g_cur->tid.x,
                 g_cur->tid.y, g_cur->tid.z);
    return buf;
}

// Records a fault of the running launch (sticky) and prints it.
void fault_record(cudaError_t e, const char *fmt, va_list ap)
{
    char msg[1024];
    vsnprintf(msg, sizeof msg, fmt, ap);
    if (B.fault || g_sticky != cudaSuccess)
        return;  // the first fault is the one that counts
    B.fault = true;
    g_sticky = e;
    g_fault = where() + ": " + msg;
    if (g_fault_print)
        fprintf(stderr, "cudaemu: FAULT in %s\n", g_fault.c_str());
}

void fault_host(cudaError_t e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void fault_host(cudaError_t e, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fault_record(e, fmt, ap);
    va_end(ap);
}

void switch_to(fiber *from, fiber *to);

// A fault in the running thread: records it and leaves the block (the
// fiber is abandoned and made afresh before its next use).
[[noreturn]] void fault(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void fault(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fault_record(cudaErrorLaunchFailure, fmt, ap);
    va_end(ap);
    switch_to(g_cur, NULL);
    abort();  // never resumed
}

fiber *need_thread(const char *what)
{
    if (!g_cur) {
        fprintf(stderr, "cudaemu: %s called outside a kernel\n", what);
        abort();
    }
    return g_cur;
}

const char *kind_name(int k)
{
    switch (k) {
    case -1: return "__syncthreads";
    case EMU_WARP_SYNC: return "__syncwarp";
    case EMU_WARP_SHFL_IDX: return "__shfl_sync";
    case EMU_WARP_SHFL_UP: return "__shfl_up_sync";
    case EMU_WARP_SHFL_DOWN: return "__shfl_down_sync";
    case EMU_WARP_SHFL_XOR: return "__shfl_xor_sync";
    case EMU_WARP_BALLOT: return "__ballot_sync";
    case EMU_WARP_ANY: return "__any_sync";
    case EMU_WARP_ALL: return "__all_sync";
    case EMU_WARP_COLLECTIVE: return "a warp-collective op";
    default: return "?";
    }
}

// ---- Switching ----

void set_current(fiber *f)
{
    g_cur = f;
    emu_cur_tid = f ? &f->tid : &g_host_tid;
}

// Saves from's context (NULL: the host's) and resumes to's. Not
// instrumented either (GCC sees that jump() does not return).
__attribute__((no_sanitize_address)) void switch_to(fiber *from, fiber *to)
{
    g_stats.switches++;
    void **fake = from ? &from->fake_stack : &g_main_fake;
    ASAN_START(fake, to ? to->stack : g_main_bottom, to ? to->stack_len : g_main_size);
    if (__builtin_setjmp(from ? from->jb : g_main_jb) == 0) {
        g_from_host = from == NULL;
        set_current(to);
        jump(to ? to->jb : g_main_jb);
    }
    // Resumed: g_cur is this context again. Coming from the host, learn its
    // stack (the host thread that runs the queue may change).
    bool host = g_from_host;
    ASAN_FINISH(g_cur ? g_cur->fake_stack : g_main_fake, host ? &g_main_bottom : NULL,
                host ? &g_main_size : NULL);
}

void fiber_exit(fiber *f);

// A fiber's life: park once (fiber_create returns), then run one body per
// block it is started for.
void fiber_main(void)
{
    fiber *f = g_creating;
    ASAN_FINISH(NULL, &g_main_bottom, &g_main_size);
    ASAN_START(&f->fake_stack, g_main_bottom, g_main_size);
    if (__builtin_setjmp(f->jb) == 0)
        jump(g_create_jb);
    // First start (switch_to jumped here).
    ASAN_FINISH(g_cur->fake_stack, NULL, NULL);
    for (;;) {
        fiber *me = g_cur;
        me->startable = 0;
        g_stats.threads++;
        g_launch->run();
        fiber_exit(me);  // returns when started for another block
    }
}

void fiber_create(fiber *f)
{
    if (!f->map) {
        size_t pg = page_size();
        f->map = (char *)mmap(NULL, STACK + pg, PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (f->map == MAP_FAILED) {
            perror("cudaemu: mmap of a fiber stack");
            abort();
        }
        mprotect(f->map, pg, PROT_NONE);  // overflow faults
        f->map_len = STACK + pg;
        f->stack = f->map + pg;
        f->stack_len = STACK;
    }
    // (A fiber abandoned by a fault left its frames' redzones behind.)
    ASAN_UNPOISON(f->stack, f->stack_len);
    static ucontext_t uc;
    getcontext(&uc);
    uc.uc_stack.ss_sp = f->stack;
    uc.uc_stack.ss_size = f->stack_len;
    uc.uc_link = NULL;
    makecontext(&uc, fiber_main, 0);
    g_creating = f;
    ASAN_START(&g_main_fake, f->stack, f->stack_len);
    if (__builtin_setjmp(g_create_jb) == 0)
        setcontext(&uc);
    ASAN_FINISH(g_main_fake, NULL, NULL);
    f->startable = 1;
    f->state = F_DONE;
}

// ---- The block's ready queue ----

void push_ready(int i)
{
    fiber *f = g_fib[i];
    f->state = F_READY;
    B.ring[(B.head + B.count) % B.n] = i;
    B.count++;
}

// Runs next (before every thread that is ready now).
void push_front(int i)
{
    fiber *f = g_fib[i];
    f->state = F_READY;
    B.head = (B.head + B.n - 1) % B.n;
    B.ring[B.head] = i;
    B.count++;
}

std::string describe_waiters()
{
    // "N at KIND file:line" per distinct place.
    std::map<std::string, int> at;
    for (int i = 0; i < B.n; i++) {
        fiber *f = g_fib[i];
        if (f->state != F_WAIT)
            continue;
        char k[320];
        snprintf(k, sizeof k, "%s at %s:%d", f->wait_what, f->wait_file, f->wait_line);
        at[k]++;
    }
    std::string s;
    for (auto &p : at)
        s += (s.empty() ? "" : "; ") + std::to_string(p.second) + " thread(s) in " + p.first;
    return s;
}

// The running thread waits (kind, file, line): runs the next ready thread;
// returns when this one is resumed.
void block_current(int kind, const char *file, int line, const char *what = NULL)
{
    fiber *f = g_cur;
    f->state = F_WAIT;
    f->wait_kind = kind;
    f->wait_what = what ? what : kind_name(kind);
    f->wait_file = file;
    f->wait_line = line;
    if (B.count == 0) {
        char live[32];
        snprintf(live, sizeof live, "%d", B.live);
        fault("deadlock: %s live thread(s), none can go on: %s", live, describe_waiters().c_str());
    }
    int next = B.ring[B.head];
    B.head = (B.head + 1) % B.n;
    B.count--;
    switch_to(f, g_fib[next]);
}

void release_barrier(void)
{
    int self = g_cur ? g_cur->index : -1;
    int w[MAX_THREADS], n = 0;
    for (int i = 0; i < B.bar_count; i++)
        if (B.bar_wait[i] != self)
            w[n++] = B.bar_wait[i];
    B.bar_count = 0;
    order(w, n);
    for (int i = 0; i < n; i++)
        push_ready(w[i]);
}

void fiber_exit(fiber *f)
{
    warp_state &w = B.warp[f->warp];
    unsigned bit = 1u << f->lane;
    for (int i = 0; i < w.ngroups; i++)
        if (w.g[i].mask & bit)
            fault("the thread exits while lanes 0x%08x of its warp wait for it in %s at %s:%d "
                  "(mask 0x%08x)",
                  w.g[i].arrived, w.g[i].what, w.g[i].file, w.g[i].line, w.g[i].mask);
    f->state = F_DONE;
    f->startable = 1;
    B.live--;
    w.live &= ~bit;
    // An exited thread no longer takes part in __syncthreads.
    if (B.bar_count > 0 && B.bar_count == B.live)
        release_barrier();
    if (B.count == 0) {
        if (B.live > 0)
            fault_host(cudaErrorLaunchFailure,
                       "deadlock: thread (%u,%u,%u) exits and the %d live thread(s) left wait for "
                       "each other: %s",
                       f->tid.x, f->tid.y, f->tid.z, B.live, describe_waiters().c_str());
        switch_to(f, NULL);  // the block is done (or dead)
        return;              // started again for another block
    }
    int next = B.ring[B.head];
    B.head = (B.head + 1) % B.n;
    B.count--;
    switch_to(f, g_fib[next]);
}

// ---- Shared memory ----

char *g_smem_map;             // [guard page][SMEM_MAP bytes][guard page]
size_t g_smem_map_len;
char *g_dyn;                  // the block's dynamic shared memory
size_t g_dyn_bytes, g_dyn_padded;
char *g_static_map;           // [guard page][STATIC_SMEM + guards][guard page]
size_t g_static_len;
char *g_static;               // its first usable byte
struct static_slot {
    const void *key;
    size_t off, bytes;
};
static_slot g_slots[256];
int g_nslots;
size_t g_static_used;
int g_optin = 232448;  // H100
std::map<const void *, int> g_func_dyn;  // cudaFuncAttributeMaxDynamicSharedMemorySize

void smem_init(void)
{
    if (g_smem_map)
        return;
    g_smem_map = map_guarded(SMEM_MAP, &g_smem_map_len);
    g_static_map = map_guarded(STATIC_SMEM + 256 * GUARD, &g_static_len);
    if (!g_smem_map || !g_static_map) {
        perror("cudaemu: mmap of shared memory");
        abort();
    }
    g_static = g_static_map + page_size();
}

void smem_start_block(size_t dyn)
{
    char *end = g_smem_map + g_smem_map_len - page_size();  // the last guard page
    g_dyn_bytes = dyn;
    // The base is 128-byte aligned (on a GPU it starts the block's shared
    // window, or follows the static arrays at the alignment the
    // declaration asks): wmma tiles need 32 bytes.
    g_dyn_padded = round_up(dyn, DYN_ALIGN);
    g_dyn = end - g_dyn_padded;
    fill32(g_dyn - LEAD, LEAD, SENTINEL);
    fill32(g_dyn, dyn, EMU_SMEM_FILL);
    fill32(g_dyn + dyn, g_dyn_padded - dyn, SENTINEL);
    g_nslots = 0;
    g_static_used = 0;
}

// 0, or a fault recorded (from the host side, after the block).
void smem_check_block(void)
{
    long i;
    if ((i = check32(g_dyn - LEAD, LEAD, SENTINEL)) >= 0)
        fault_host(cudaErrorIllegalAddress,
                   "a write %ld byte(s) before the start of dynamic shared memory",
                   (long)LEAD - i);
    else if ((i = check32(g_dyn + g_dyn_bytes, g_dyn_padded - g_dyn_bytes, SENTINEL)) >= 0)
        fault_host(cudaErrorIllegalAddress,
                   "a write past the end of dynamic shared memory (%zu bytes), at byte %zu",
                   g_dyn_bytes, g_dyn_bytes + (size_t)i);
    for (int s = 0; s < g_nslots && !B.fault; s++) {
        const static_slot &sl = g_slots[s];
        const char *p = g_static + sl.off + sl.bytes;
        if ((i = check32(p, GUARD, SENTINEL)) >= 0)
            fault_host(cudaErrorIllegalAddress,
                       "a write past the end of a static __shared__ array of %zu bytes, at "
                       "byte %zu",
                       sl.bytes, sl.bytes + (size_t)i);
    }
}

// ---- Device memory ----

struct alloc {
    char *map;
    size_t map_len;
    char *base;
    size_t bytes, padded;
};
std::map<uintptr_t, alloc> g_allocs;  // by base

const alloc *find_alloc(const void *p)
{
    uintptr_t a = (uintptr_t)p;
    auto it = g_allocs.upper_bound(a);
    if (it == g_allocs.begin())
        return NULL;
    --it;
    const alloc &al = it->second;
    if (a >= (uintptr_t)al.base && a <= (uintptr_t)al.base + al.bytes)
        return &al;
    return NULL;
}

bool in_device(const void *p, size_t bytes)
{
    const alloc *a = find_alloc(p);
    return a && (uintptr_t)p + bytes <= (uintptr_t)a->base + a->bytes;
}

void check_pads(void)
{
    for (auto &it : g_allocs) {
        const alloc &a = it.second;
        long i = check32(a.base + a.bytes, a.padded - a.bytes, SENTINEL);
        if (i >= 0) {
            fault_host(cudaErrorIllegalAddress,
                       "a write %ld byte(s) past the end of a device allocation of %zu bytes at %p",
                       i + 1, a.bytes, (void *)a.base);
            fill32(a.base + a.bytes, a.padded - a.bytes, SENTINEL);
        }
    }
}

// ---- Streams and the queue ----

struct emu_stream_obj {
    int unused;
};
std::set<cudaStream_t> g_streams;

struct work {
    int kind;  // 0 launch, 1 copy, 2 set
    emu_launch_base *launch;
    void *dst;
    const void *src;
    size_t bytes;
    int value;
};
std::deque<work> g_queue;

bool stream_ok(cudaStream_t s) { return s == 0 || g_streams.count(s) != 0; }

// ---- Running a launch ----

void run_block(int nthreads)
{
    B.n = nthreads;
    B.live = nthreads;
    B.head = 0;
    B.count = 0;
    B.bar_count = 0;
    B.fault = false;
    B.nwarps = (nthreads + WARP - 1) / WARP;
    for (int w = 0; w < B.nwarps; w++) {
        int lanes = std::min(WARP, nthreads - w * WARP);
        B.warp[w].exists = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1;
        B.warp[w].live = B.warp[w].exists;
        B.warp[w].ngroups = 0;
    }
    smem_start_block(g_launch->smem);
    int ord[MAX_THREADS];
    for (int i = 0; i < nthreads; i++) {
        fiber *f = g_fib[i];
        if (!f->startable)
            fiber_create(f);
        ord[i] = i;
    }
    order(ord, nthreads);
    for (int i = 0; i < nthreads; i++)
        push_ready(ord[i]);
    int first = B.ring[B.head];
    B.head = (B.head + 1) % B.n;
    B.count--;
    g_stats.blocks++;
    g_in_block = true;
    switch_to(NULL, g_fib[first]);
    // Back on the host: the block is done, or a thread faulted.
    if (!B.fault)
        smem_check_block();
    g_in_block = false;
}

void run_launch(emu_launch_base *l)
{
    g_launch = l;
    g_stats.launches++;
    B.fault = false;
    std::string k = std::string(l->name) + "[" + std::to_string(l->smem) + "]";
    if (std::find(g_klog.begin(), g_klog.end(), k) == g_klog.end())
        g_klog.push_back(k);
    emu_block_idx = { 0, 0, 0 };
    if (l->bad_arg[0]) {
        fault_host(cudaErrorIllegalAddress, "%s", l->bad_arg);
        B.fault = false;
        g_launch = NULL;
        return;
    }
    smem_init();
    const dim3 bd = l->block, gd = l->grid;
    int nthreads = (int)(bd.x * bd.y * bd.z);
    emu_block_dim = { bd.x, bd.y, bd.z };
    emu_grid_dim = { gd.x, gd.y, gd.z };
    for (int i = 0; i < nthreads; i++) {
        if (!g_fib[i]) {
            g_fib[i] = new fiber();
            g_fib[i]->map = NULL;
            g_fib[i]->startable = 0;
        }
        fiber *f = g_fib[i];
        f->index = i;
        f->lane = i % WARP;
        f->warp = i / WARP;
        f->tid = { (unsigned)i % bd.x, (unsigned)i / bd.x % bd.y, (unsigned)i / (bd.x * bd.y) };
    }
    // Blocks in the policy's order: i -> (a·i + c) mod n, a coprime to n.
    uint64_t n = (uint64_t)gd.x * gd.y * gd.z, a = 1, c = 0;
    if (g_order == EMU_ORDER_RANDOM && n > 1) {
        do
            a = rnd() % n | 1;
        while (std::gcd(a, n) != 1);
        c = rnd() % n;
    }
    for (uint64_t i = 0; i < n && !B.fault; i++) {
        uint64_t k = g_order == EMU_ORDER_FORWARD ? i
                     : g_order == EMU_ORDER_REVERSE ? n - 1 - i
                                                     : (a * i + c) % n;
        emu_block_idx = { (unsigned)(k % gd.x), (unsigned)(k / gd.x % gd.y),
                          (unsigned)(k / ((uint64_t)gd.x * gd.y)) };
        run_block(nthreads);
    }
    // Threads left mid-body (a fault) are not startable: fiber_create makes
    // them afresh before their next use.
    set_current(NULL);
    check_pads();
    B.fault = false;
    g_launch = NULL;
}

void flush(void)
{
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    while (!g_queue.empty()) {
        work w = g_queue.front();
        g_queue.pop_front();
        if (g_sticky != cudaSuccess) {
            delete w.launch;
            continue;
        }
        if (w.kind == 0) {
            run_launch(w.launch);
            delete w.launch;
        } else if (w.kind == 1) {
            memmove(w.dst, w.src, w.bytes);
        } else {
            memset(w.dst, w.value, w.bytes);
        }
    }
}

// ---- SIGSEGV: say which guard a kernel ran into ----

void on_segv(int sig, siginfo_t *si, void *uc)
{
    (void)uc;
    uintptr_t a = (uintptr_t)si->si_addr;
    char msg[1024];
    const char *what = "an address that is not mapped (a host pointer, freed device memory?)";
    char detail[256] = "";
    for (auto &it : g_allocs) {
        const alloc &al = it.second;
        if (a >= (uintptr_t)al.map && a < (uintptr_t)al.map + al.map_len) {
            if (a >= (uintptr_t)al.base)
                snprintf(detail, sizeof detail,
                         "%zu byte(s) past the end of a device allocation of %zu bytes at %p",
                         (size_t)(a - (uintptr_t)al.base) - al.bytes, al.bytes, (void *)al.base);
            else
                snprintf(detail, sizeof detail,
                         "%zu byte(s) before a device allocation of %zu bytes at %p",
                         (size_t)((uintptr_t)al.base - a), al.bytes, (void *)al.base);
            what = detail;
        }
    }
    if (g_smem_map && a >= (uintptr_t)g_smem_map && a < (uintptr_t)g_smem_map + g_smem_map_len) {
        snprintf(detail, sizeof detail, "past the end of dynamic shared memory (%zu bytes)",
                 g_dyn_bytes);
        what = detail;
    }
    if (g_static_map && a >= (uintptr_t)g_static_map &&
        a < (uintptr_t)g_static_map + g_static_len)
        what = "past the end of static shared memory";
    for (int i = 0; i < MAX_THREADS; i++)
        if (g_fib[i] && g_fib[i]->map && a >= (uintptr_t)g_fib[i]->map &&
            a < (uintptr_t)g_fib[i]->stack)
            what = "stack overflow in a CUDA thread";
    std::string w = g_launch ? where() : std::string("host code");
    int n = snprintf(msg, sizeof msg, "cudaemu: segmentation fault at %p in %s: %s\n",
                     (void *)a, w.c_str(), what);
    if (n > 0)
        (void)!write(2, msg, (size_t)n < sizeof msg ? (size_t)n : sizeof msg - 1);
    signal(sig, SIG_DFL);  // the access repeats and kills the process
}

struct init_segv {
    init_segv()
    {
        static char altstack[64 * 1024];
        stack_t ss;
        ss.ss_sp = altstack;
        ss.ss_size = sizeof altstack;
        ss.ss_flags = 0;
        sigaltstack(&ss, NULL);
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_segv;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGSEGV, &sa, NULL);
        sigaction(SIGBUS, &sa, NULL);
    }
} g_init_segv;

// Group gi of warp w is complete (f, the running thread, arrived last):
// removes it and wakes its other lanes.
void finish_group(warp_state &w, int gi, fiber *f)
{
    const unsigned mask = w.g[gi].mask;
    w.g[gi] = w.g[--w.ngroups];
    int wake[WARP], n = 0;
    for (int l = 0; l < WARP; l++)
        if ((mask >> l & 1) && l != f->lane)
            wake[n++] = f->warp * WARP + l;
    order(wake, n);
    // Forward order: the woken lanes queue behind every ready thread, so
    // warps advance together. Reverse (and, at random, random) order: they
    // run next, so this warp runs ahead of the others up to its next
    // barrier, as a GPU's warp scheduler may let it; a barrier missing
    // between warps then shows.
    bool ahead = g_order == EMU_ORDER_REVERSE || (g_order == EMU_ORDER_RANDOM && (rnd() & 1));
    if (ahead)
        for (int i = n - 1; i >= 0; i--)
            push_front(wake[i]);
    else
        for (int i = 0; i < n; i++)
            push_ready(wake[i]);
}

}  // namespace

// ---- Built-in variables ----

const uint3 *emu_cur_tid = &g_host_tid;
uint3 emu_block_idx, emu_block_dim, emu_grid_dim;

// ---- Synchronisation ----

void emu_syncthreads(const char *file, int line)
{
    fiber *f = need_thread("__syncthreads");
    if (B.bar_count == 0) {
        B.bar_file = file;
        B.bar_line = line;
    } else if (B.bar_line != line || strcmp(B.bar_file, file) != 0) {
        fault("divergent __syncthreads: this thread is at %s:%d while %d thread(s) wait at %s:%d",
              file, line, B.bar_count, B.bar_file, B.bar_line);
    }
    B.bar_wait[B.bar_count++] = f->index;
    if (B.bar_count == B.live) {
        release_barrier();
        return;
    }
    block_current(-1, file, line);
}

uint64_t emu_warp_op(const char *file, int line, int kind, unsigned mask, uint64_t value, int b,
                     int c)
{
    fiber *f = need_thread(kind_name(kind));
    warp_state &w = B.warp[f->warp];
    const int lane = f->lane;
    const unsigned bit = 1u << lane;
    if (!(mask & bit))
        fault("%s at %s:%d with mask 0x%08x, which does not name the calling lane %d",
              kind_name(kind), file, line, mask, lane);
    if (mask & ~w.exists)
        fault("%s at %s:%d with mask 0x%08x names lanes that do not exist (warp lanes 0x%08x)",
              kind_name(kind), file, line, mask, w.exists);
    if (mask & ~w.live)
        fault("%s at %s:%d with mask 0x%08x names lanes that have exited (live 0x%08x)",
              kind_name(kind), file, line, mask, w.live);
    int gi = -1;
    for (int i = 0; i < w.ngroups; i++) {
        group &g = w.g[i];
        if (g.mask == mask) {
            gi = i;
            break;
        }
        if (g.mask & mask)
            fault("divergent warp op: lane %d calls %s at %s:%d with mask 0x%08x while lanes "
                  "0x%08x wait in %s at %s:%d with mask 0x%08x",
                  lane, kind_name(kind), file, line, mask, g.arrived, g.what, g.file, g.line,
                  g.mask);
    }
    if (gi < 0) {
        gi = w.ngroups++;
        w.g[gi] = { mask, 0, kind, file, line, kind_name(kind) };
    } else {
        group &g = w.g[gi];
        if (g.kind != kind || (kind != EMU_WARP_SYNC && (g.line != line || strcmp(g.file, file))))
            fault("divergent warp op: lane %d calls %s at %s:%d while lanes 0x%08x wait in %s at "
                  "%s:%d (mask 0x%08x)",
                  lane, kind_name(kind), file, line, g.arrived, g.what, g.file, g.line, mask);
    }
    w.val[lane] = value;
    w.b[lane] = b;
    w.c[lane] = c;
    w.g[gi].arrived |= bit;
    if (w.g[gi].arrived != mask) {
        block_current(kind, file, line);
        return w.res[lane];
    }
    // The last lane of the group: every lane's result, then wake them.
    if (kind == EMU_WARP_SHFL_IDX || kind == EMU_WARP_SHFL_UP || kind == EMU_WARP_SHFL_DOWN ||
        kind == EMU_WARP_SHFL_XOR) {
        for (int l = 0; l < WARP; l++) {
            if (!(mask >> l & 1))
                continue;
            // PTX shfl.sync, lane by lane.
            int bval = w.b[l] & 31, cval = w.c[l] & 31, seg = (w.c[l] >> 8) & 31;
            int maxl = (l & seg) | (cval & ~seg), minl = l & seg, j;
            bool p;
            switch (kind) {
            case EMU_WARP_SHFL_UP: j = l - bval; p = j >= maxl; break;
            case EMU_WARP_SHFL_DOWN: j = l + bval; p = j <= maxl; break;
            case EMU_WARP_SHFL_XOR: j = l ^ bval; p = j <= maxl; break;
            default: j = minl | (bval & ~seg); p = j <= maxl; break;
            }
            if (!p)
                j = l;
            if (!(mask >> j & 1))
                fault("%s at %s:%d: lane %d reads lane %d, which is not in the mask 0x%08x",
                      kind_name(kind), file, line, l, j, mask);
            w.res[l] = w.val[j];
        }
    } else {
        unsigned ballot = 0;
        for (int l = 0; l < WARP; l++)
            if ((mask >> l & 1) && w.val[l])
                ballot |= 1u << l;
        uint64_t r = kind == EMU_WARP_BALLOT ? ballot
                     : kind == EMU_WARP_ANY  ? ballot != 0
                     : kind == EMU_WARP_ALL  ? ballot == mask
                                             : 0;
        for (int l = 0; l < WARP; l++)
            if (mask >> l & 1)
                w.res[l] = r;
    }
    finish_group(w, gi, f);
    return w.res[lane];
}

void emu_warp_collective(const char *file, int line, const char *what, const void *args,
                         size_t args_len, void *lane_data, emu_collective_fn run)
{
    fiber *f = need_thread(what);
    warp_state &w = B.warp[f->warp];
    const int lane = f->lane;
    const unsigned bit = 1u << lane, mask = 0xffffffffu;
    if (args_len > EMU_COLLECTIVE_ARGS)
        fault("%s at %s:%d: %zu bytes of arguments (the emulator keeps %d)", what, file, line,
              args_len, EMU_COLLECTIVE_ARGS);
    if (w.exists != mask)
        fault("%s at %s:%d in a warp of %d thread(s): all 32 lanes of a warp must call it", what,
              file, line, __builtin_popcount(w.exists));
    if (w.live != mask)
        fault("%s at %s:%d while lanes 0x%08x of the warp have exited: all 32 lanes must call it",
              what, file, line, w.exists & ~w.live);
    int gi = -1;
    for (int i = 0; i < w.ngroups; i++) {
        group &g = w.g[i];
        // Every group overlaps a full mask: it must be this op's.
        if (g.kind != EMU_WARP_COLLECTIVE || g.line != line || strcmp(g.file, file) ||
            strcmp(g.what, what))
            fault("divergent warp op: lane %d calls %s at %s:%d while lanes 0x%08x wait in %s at "
                  "%s:%d (mask 0x%08x): all 32 lanes must call %s together",
                  lane, what, file, line, g.arrived, g.what, g.file, g.line, g.mask, what);
        gi = i;
    }
    if (gi < 0) {
        gi = w.ngroups++;
        w.g[gi] = { mask, 0, EMU_WARP_COLLECTIVE, file, line, what };
        memcpy(w.cargs, args, args_len);
        w.clen = args_len;
    } else if (w.clen != args_len || memcmp(w.cargs, args, args_len) != 0) {
        fault("%s at %s:%d: lane %d passes other arguments than lanes 0x%08x (pointer, ldm, "
              "layout or value): all 32 lanes must pass the same",
              what, file, line, lane, w.g[gi].arrived);
    }
    w.cdata[lane] = lane_data;
    w.g[gi].arrived |= bit;
    if (w.g[gi].arrived != mask) {
        block_current(EMU_WARP_COLLECTIVE, file, line, what);
        return;
    }
    // The last lane: the warp's one converged instruction, then wake the others.
    run(w.cdata, w.cargs);
    finish_group(w, gi, f);
}

void emu_kernel_fault(const char *fmt, ...)
{
    need_thread("emu_kernel_fault");
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fault("%s", msg);
}

int emu_lane(void) { return need_thread("emu_lane")->lane; }

// ---- Shared memory ----

void *emu_static_shared_alloc(const void *key, size_t bytes, size_t align)
{
    need_thread("a static __shared__ declaration");
    for (int i = 0; i < g_nslots; i++)
        if (g_slots[i].key == key) {
            if (g_slots[i].bytes != bytes)
                fault("a static __shared__ array changes size within a block (%zu, then %zu bytes)",
                      g_slots[i].bytes, bytes);
            return g_static + g_slots[i].off;
        }
    size_t off = round_up(g_static_used, std::max<size_t>(align, 16));
    if (off + bytes > STATIC_SMEM || g_nslots == (int)(sizeof g_slots / sizeof g_slots[0]))
        fault("static __shared__ arrays over 48 KiB (%zu bytes)", off + bytes);
    if (off + bytes + g_launch->smem > (size_t)std::max<int>(g_optin, (int)DEFAULT_SMEM))
        fault("%zu bytes of static and %zu of dynamic shared memory exceed the device's %d",
              off + bytes, g_launch->smem, g_optin);
    fill32(g_static + off, bytes, EMU_SMEM_FILL);
    fill32(g_static + off + bytes, GUARD, SENTINEL);
    g_slots[g_nslots++] = { key, off, bytes };
    g_static_used = off + bytes + GUARD;
    return g_static + off;
}

void *emu_dynamic_shared_base(void)
{
    need_thread("extern __shared__");
    return g_dyn;
}

// ---- Launches ----

void emu_check_kernel_pointer(emu_launch_base *l, int index, const void *p)
{
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    if (!p || find_alloc(p) || l->bad_arg[0])
        return;
    snprintf(l->bad_arg, sizeof l->bad_arg,
             "argument %d of the launch (%p) is not device memory (a host pointer?)", index + 1,
             p);
}

void emu_submit_launch(emu_launch_base *l)
{
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    if (g_sticky != cudaSuccess) {
        delete l;
        return;
    }
    const dim3 g = l->grid, b = l->block;
    unsigned long long threads = (unsigned long long)b.x * b.y * b.z;
    cudaError_t e = cudaSuccess;
    const char *why = "";
    if (!stream_ok(l->stream)) {
        e = cudaErrorInvalidResourceHandle;
        why = "not a stream";
    } else if (g.x == 0 || g.y == 0 || g.z == 0 || g.x > 0x7fffffffu || g.y > 65535 ||
               g.z > 65535) {
        e = cudaErrorInvalidConfiguration;
        why = "bad grid";
    } else if (threads == 0 || threads > (unsigned long long)MAX_THREADS || b.x > 1024 ||
               b.y > 1024 || b.z > 64) {
        e = cudaErrorInvalidConfiguration;
        why = "bad block";
    } else if (threads > (unsigned long long)l->max_threads) {
        e = cudaErrorLaunchOutOfResources;
        why = "more threads than the kernel's __launch_bounds__";
    } else {
        auto it = g_func_dyn.find(l->kernel);
        size_t lim = it != g_func_dyn.end() ? (size_t)it->second : DEFAULT_SMEM;
        if (l->smem > lim) {
            e = cudaErrorInvalidValue;
            why = "more dynamic shared memory than the kernel may use (cudaFuncSetAttribute)";
        }
    }
    if (e != cudaSuccess) {
        if (g_fault_print)
            fprintf(stderr,
                    "cudaemu: launch of %s at %s:%d refused (%s): grid (%u,%u,%u) block "
                    "(%u,%u,%u), %zu bytes of dynamic shared memory\n",
                    l->name, l->file, l->line, why, g.x, g.y, g.z, b.x, b.y, b.z, l->smem);
        set_last(e);
        delete l;
        return;
    }
    g_queue.push_back(work{ 0, l, NULL, NULL, 0, 0 });
}

// ---- The runtime API ----

cudaError_t cudaGetLastError(void)
{
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    if (g_sticky != cudaSuccess)
        return g_sticky;
    cudaError_t e = g_last;
    g_last = cudaSuccess;
    return e;
}

cudaError_t cudaPeekAtLastError(void)
{
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    return g_sticky != cudaSuccess ? g_sticky : g_last;
}

const char *cudaGetErrorName(cudaError_t e)
{
    switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDeviceFunction: return "cudaErrorInvalidDeviceFunction";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorLaunchOutOfResources: return "cudaErrorLaunchOutOfResources";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    }
    return "cudaErrorUnknown";
}

const char *cudaGetErrorString(cudaError_t e)
{
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDeviceFunction: return "invalid device function";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    }
    return "unknown error";
}

void *emu_device_malloc(size_t bytes)
{
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    size_t pg = page_size(), padded = round_up(bytes ? bytes : 1, 16);
    size_t map_len = 0;
    char *m = map_guarded(padded, &map_len);
    if (!m)
        return NULL;
    // The data ends where the second guard page starts.
    char *base = m + map_len - pg - padded;
    fill32(base, bytes, 0xffffffffu);  // garbage, as cudaMalloc's (a NaN as float)
    fill32(base + bytes, padded - bytes, SENTINEL);
    g_allocs[(uintptr_t)base] = alloc{ m, map_len, base, bytes, padded };
    return base;
}

void emu_device_free(void *p)
{
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    if (!p)
        return;
    auto it = g_allocs.find((uintptr_t)p);
    if (it == g_allocs.end()) {
        fprintf(stderr, "cudaemu: cudaFree(%p): not the start of a device allocation\n", p);
        abort();
    }
    check_pads();
    munmap(it->second.map, it->second.map_len);
    g_allocs.erase(it);
}

int emu_is_device(const void *p, size_t bytes)
{
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    return in_device(p, bytes);
}

cudaError_t cudaMalloc(void **p, size_t bytes)
{
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    if (!p)
        return set_last(cudaErrorInvalidValue);
    if (g_sticky != cudaSuccess)
        return g_sticky;
    *p = emu_device_malloc(bytes);
    return *p ? cudaSuccess : set_last(cudaErrorMemoryAllocation);
}

cudaError_t cudaFree(void *p)
{
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    flush();  // cudaFree waits for the device
    if (p && !g_allocs.count((uintptr_t)p))
        return set_last(cudaErrorInvalidValue);
    emu_device_free(p);
    return g_sticky;
}

namespace {

cudaError_t check_copy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind)
{
    bool dd = find_alloc(dst) != NULL, sd = find_alloc(src) != NULL;
    if (kind == cudaMemcpyDefault)
        kind = dd ? (sd ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                  : (sd ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
    bool want_dd = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
    bool want_sd = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
    const char *bad = NULL;
    if (!dst || !src)
        bad = "a NULL pointer";
    else if (want_dd != dd)
        bad = want_dd ? "the destination is not device memory" : "the destination is device memory";
    else if (want_sd != sd)
        bad = want_sd ? "the source is not device memory" : "the source is device memory";
    else if (dd && !in_device(dst, bytes))
        bad = "the destination range runs past the end of its allocation";
    else if (sd && !in_device(src, bytes))
        bad = "the source range runs past the end of its allocation";
    if (bad) {
        if (g_fault_print)
            fprintf(stderr, "cudaemu: cudaMemcpy(%p, %p, %zu, kind %d) refused: %s\n", dst, src,
                    bytes, (int)kind, bad);
        return set_last(cudaErrorInvalidValue);
    }
    return cudaSuccess;
}

}  // namespace

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t s)
{
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    if (g_sticky != cudaSuccess)
        return g_sticky;
    if (!stream_ok(s))
        return set_last(cudaErrorInvalidResourceHandle);
    if (bytes == 0)
        return cudaSuccess;
    cudaError_t e = check_copy(dst, src, bytes, kind);
    if (e != cudaSuccess)
        return e;
    // Runs in stream order, when the queue runs: a host buffer must stay as
    // it is until the stream is synchronised (as pinned memory must).
    g_queue.push_back(work{ 1, NULL, dst, src, bytes, 0 });
    return cudaSuccess;
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind)
{
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, 0);
    flush();
    return e != cudaSuccess ? e : g_sticky;
}

cudaError_t cudaMemsetAsync(void *dst, int value, size_t bytes, cudaStream_t s)
{
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    if (g_sticky != cudaSuccess)
        return g_sticky;
    if (!stream_ok(s))
        return set_last(cudaErrorInvalidResourceHandle);
    if (bytes == 0)
        return cudaSuccess;
    if (!dst || !in_device(dst, bytes)) {
        if (g_fault_print)
            fprintf(stderr, "cudaemu: cudaMemset(%p, %d, %zu) refused: not device memory\n", dst,
                    value, bytes);
        return set_last(cudaErrorInvalidValue);
    }
    g_queue.push_back(work{ 2, NULL, dst, NULL, bytes, value });
    return cudaSuccess;
}

cudaError_t cudaMemset(void *dst, int value, size_t bytes)
{
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    cudaError_t e = cudaMemsetAsync(dst, value, bytes, 0);
    flush();
    return e != cudaSuccess ? e : g_sticky;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags)
{
    (void)flags;
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    if (!s)
        return set_last(cudaErrorInvalidValue);
    *s = reinterpret_cast<cudaStream_t>(new emu_stream_obj());
    g_streams.insert(*s);
    return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t s)
{
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    if (!s || !g_streams.count(s))
        return set_last(cudaErrorInvalidResourceHandle);
    flush();
    g_streams.erase(s);
    delete reinterpret_cast<emu_stream_obj *>(s);
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s)
{
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    if (!stream_ok(s))
        return set_last(cudaErrorInvalidResourceHandle);
    flush();
    return g_sticky;
}

cudaError_t cudaDeviceSynchronize(void)
{
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    flush();
    return g_sticky;
}

cudaError_t cudaGetDevice(int *d)
{
    if (!d)
        return set_last(cudaErrorInvalidValue);
    *d = 0;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int d) { return d == 0 ? cudaSuccess : set_last(cudaErrorInvalidDevice); }

cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr a, int device)
{
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    if (!v || device != 0)
        return set_last(cudaErrorInvalidValue);
    switch (a) {
    case cudaDevAttrMaxThreadsPerBlock: *v = MAX_THREADS; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *v = (int)DEFAULT_SMEM; break;
    case cudaDevAttrWarpSize: *v = WARP; break;
    case cudaDevAttrMultiProcessorCount: *v = 132; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *v = g_optin; break;
    default: return set_last(cudaErrorInvalidValue);
    }
    return cudaSuccess;
}

cudaError_t emu_func_set_attribute(const void *kernel, cudaFuncAttribute a, int v)
{
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    if (!kernel)
        return set_last(cudaErrorInvalidDeviceFunction);
    if (a == cudaFuncAttributeMaxDynamicSharedMemorySize) {
        if (v < 0 || v > g_optin)
            return set_last(cudaErrorInvalidValue);
        g_func_dyn[kernel] = v;
        return cudaSuccess;
    }
    if (a == cudaFuncAttributePreferredSharedMemoryCarveout)
        return v >= -1 && v <= 100 ? cudaSuccess : set_last(cudaErrorInvalidValue);
    return set_last(cudaErrorInvalidValue);
}

// ---- For tests ----

cudaError_t emu_sync(void)
{
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    flush();
    return g_sticky;
}

void emu_reset_device(void)
{
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    for (auto &w : g_queue)
        delete w.launch;
    g_queue.clear();
    g_sticky = cudaSuccess;
    g_last = cudaSuccess;
    g_fault.clear();
}

void emu_set_schedule(int order_, uint64_t seed)
{
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    g_order = order_;
    g_rng = seed ? seed : 0x9e3779b97f4a7c15ull;
}

void emu_set_smem_optin(int bytes)
{
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    g_optin = std::min<int>(bytes, (int)(SMEM_MAP - 4096));
    // A device with less shared memory: the attributes set for another are gone.
    g_func_dyn.clear();
}

const char *emu_last_fault(void) { return g_fault.c_str(); }

void emu_set_fault_print(int on) { g_fault_print = on; }

emu_stats emu_get_stats(void) { return g_stats; }

void emu_kernel_log(char *buf, size_t len)
{
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    std::string s;
    for (auto &k : g_klog)
        s += (s.empty() ? "" : ", ") + k;
    g_klog.clear();
    if (len)
        snprintf(buf, len, "%s", s.c_str());
}
