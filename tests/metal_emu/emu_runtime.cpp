// emu_runtime.cpp: runs an emulated Metal kernel grid on the CPU (see docs/kernels.md).
//
// Each threadgroup runs alone; each of its threads is a fiber (ucontext). A fiber runs until
// it finishes or blocks at a threadgroup_barrier or a SIMD-group op; the scheduler sweeps
// the fibers in a chosen order (forward, reverse, or shuffled) until all finish. Barriers
// and SIMD ops release only when every live thread of the threadgroup / simdgroup arrived,
// so they behave as on a GPU, and running the grid under several orders exposes data races.
//
// Usage: <binary> LAUNCH_FILE OUTPUT_FILE (formats written/read by emulate.py).
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "emu_abi.h"

namespace {

constexpr int kMaxThreads = 1024;
constexpr size_t kStack = 256 * 1024;
constexpr size_t kThreadgroupMemory = 32 * 1024;  // Apple GPUs: 32 KiB per threadgroup

enum State { RUNNABLE, AT_BARRIER, AT_SIMD, DONE };

struct Fiber {
  ucontext_t ctx;
  char* stack = nullptr;
  State state = DONE;
  EmuThreadIds ids;
  EmuSimdView view;
  int line = 0;
};

struct Simdgroup {
  int live = 0, arrived = 0, op = 0, line = 0;
  uint32_t mask = 0;
  uint64_t slots[32];
};

struct Site {
  int site;
  size_t offset, size;
};

ucontext_t g_sched;
std::vector<Fiber> g_fibers(kMaxThreads);
std::vector<Simdgroup> g_sgs(kMaxThreads / 32);
Fiber* g_cur = nullptr;
const EmuBuffer* g_buffers = nullptr;
int g_nthreads = 0, g_live = 0, g_at_barrier = 0, g_done = 0, g_barrier_line = 0;
alignas(64) unsigned char g_tg_mem[kThreadgroupMemory];
size_t g_tg_used = 0;
std::vector<Site> g_sites;
char g_where[160] = "";

[[noreturn]] void fail(const std::string& msg) {
  std::fprintf(stderr, "metal-emu: %s (%s)\n", msg.c_str(), g_where);
  std::fflush(stderr);
  _exit(3);
}

void on_segv(int sig) {
  const char* m = sig == SIGSEGV ? "metal-emu: SIGSEGV: out-of-bounds memory access in kernel ("
                                 : "metal-emu: fatal signal in kernel (";
  ssize_t r = write(2, m, std::strlen(m));
  r = write(2, g_where, std::strlen(g_where));
  r = write(2, ")\n", 2);
  (void)r;
  _exit(4);
}

void release_simdgroup(uint32_t s);

void fiber_main() {
  emu_kernel_thread(g_buffers, &g_cur->ids);
  Fiber* f = g_cur;
  f->state = DONE;
  ++g_done;
  --g_live;
  if (g_at_barrier > 0) fail("a thread exited while others wait at threadgroup_barrier");
  // Lanes that exited take no part in SIMD-group ops (Metal: inactive lanes).
  const uint32_t s = f->ids.simdgroup_index_in_threadgroup;
  if (--g_sgs[s].live == g_sgs[s].arrived && g_sgs[s].arrived > 0) release_simdgroup(s);
}  // returns to g_sched through uc_link

void yield_to_scheduler() { swapcontext(&g_cur->ctx, &g_sched); }

// Every live lane of simdgroup `s` posted: hand each the posted values and wake them.
void release_simdgroup(uint32_t s) {
  Simdgroup& sg = g_sgs[s];
  const int base = int(s) * 32;
  for (int i = base; i < base + 32 && i < g_nthreads; ++i) {
    Fiber& o = g_fibers[i];
    if (o.state != AT_SIMD) continue;
    std::memcpy(o.view.slots, sg.slots, sizeof(sg.slots));
    o.view.active = sg.mask;
    o.view.lane = o.ids.thread_index_in_simdgroup;
    o.state = RUNNABLE;
  }
  sg.arrived = 0;
}

void run_threadgroup(const uint32_t tgpos[3], const int grid[3], const int tg[3],
                     int schedule, uint32_t* rng) {
  uint32_t n[3];
  for (int d = 0; d < 3; ++d) {
    uint32_t rem = uint32_t(grid[d]) - tgpos[d] * uint32_t(tg[d]);
    n[d] = rem < uint32_t(tg[d]) ? rem : uint32_t(tg[d]);
  }
  g_nthreads = int(n[0] * n[1] * n[2]);
  const int dispatch = tg[0] * tg[1] * tg[2];
  std::snprintf(g_where, sizeof(g_where), "threadgroup (%u, %u, %u)", tgpos[0], tgpos[1],
                tgpos[2]);
  std::memset(g_tg_mem, 0xff, sizeof(g_tg_mem));  // poison: threadgroup memory starts undefined
  g_tg_used = 0;
  g_sites.clear();
  g_live = g_nthreads;
  g_at_barrier = g_done = 0;
  const int nsg = (g_nthreads + 31) / 32;
  for (int s = 0; s < nsg; ++s) {
    g_sgs[s] = Simdgroup();
    g_sgs[s].live = (s + 1) * 32 <= g_nthreads ? 32 : g_nthreads - s * 32;
  }
  for (int i = 0; i < g_nthreads; ++i) {
    Fiber& f = g_fibers[i];
    uint32_t l[3] = {uint32_t(i) % n[0], (uint32_t(i) / n[0]) % n[1],
                     uint32_t(i) / (n[0] * n[1])};
    EmuThreadIds& id = f.ids;
    for (int d = 0; d < 3; ++d) {
      id.thread_position_in_grid[d] = tgpos[d] * uint32_t(tg[d]) + l[d];
      id.thread_position_in_threadgroup[d] = l[d];
      id.threadgroup_position_in_grid[d] = tgpos[d];
      id.threadgroups_per_grid[d] = (uint32_t(grid[d]) + tg[d] - 1) / uint32_t(tg[d]);
      id.threads_per_grid[d] = id.grid_size[d] = uint32_t(grid[d]);
      id.grid_origin[d] = 0;
      id.threads_per_threadgroup[d] = n[d];
      id.dispatch_threads_per_threadgroup[d] = uint32_t(tg[d]);
    }
    id.thread_index_in_threadgroup = uint32_t(i);
    id.thread_index_in_simdgroup = uint32_t(i) % 32;
    id.simdgroup_index_in_threadgroup = uint32_t(i) / 32;
    id.simdgroups_per_threadgroup = uint32_t(nsg);
    id.dispatch_simdgroups_per_threadgroup = uint32_t((dispatch + 31) / 32);
    id.threads_per_simdgroup = id.thread_execution_width = 32;
    id.thread_index_in_quadgroup = uint32_t(i) % 4;
    id.quadgroup_index_in_threadgroup = uint32_t(i) / 4;
    id.quadgroups_per_threadgroup = uint32_t((g_nthreads + 3) / 4);
    id.dispatch_quadgroups_per_threadgroup = uint32_t((dispatch + 3) / 4);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kStack;
    f.ctx.uc_link = &g_sched;
    makecontext(&f.ctx, fiber_main, 0);
    f.state = RUNNABLE;
  }
  std::vector<int> order(g_nthreads);
  for (int i = 0; i < g_nthreads; ++i) order[i] = schedule == 1 ? g_nthreads - 1 - i : i;
  while (g_done < g_nthreads) {
    if (schedule == 2) {  // a fresh shuffled order for every sweep (xorshift32)
      for (int i = g_nthreads - 1; i > 0; --i) {
        *rng ^= *rng << 13, *rng ^= *rng >> 17, *rng ^= *rng << 5;
        std::swap(order[i], order[*rng % uint32_t(i + 1)]);
      }
    }
    bool progressed = false;
    for (int i : order) {
      Fiber& f = g_fibers[i];
      if (f.state != RUNNABLE) continue;
      g_cur = &f;
      swapcontext(&g_sched, &f.ctx);
      progressed = true;
    }
    if (!progressed && g_done < g_nthreads) {
      fail("deadlock: " + std::to_string(g_at_barrier) + " thread(s) wait at a barrier, " +
           std::to_string(g_live - g_at_barrier) +
           " in SIMD-group ops (divergent barrier or SIMD op)");
    }
  }
}

std::vector<char> read_file(const char* path) {
  FILE* f = std::fopen(path, "rb");
  if (!f) fail(std::string("cannot open ") + path);
  std::vector<char> data;
  char buf[1 << 16];
  size_t k;
  while ((k = std::fread(buf, 1, sizeof(buf), f)) > 0) data.insert(data.end(), buf, buf + k);
  std::fclose(f);
  return data;
}

// Buffer whose end touches a PROT_NONE page, so reads or writes past it fault.
void* guarded_alloc(size_t nbytes) {
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  const size_t body = (nbytes + page - 1) / page * page;
  char* base = static_cast<char*>(
      mmap(nullptr, body + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (base == MAP_FAILED) fail("mmap failed");
  mprotect(base + body, page, PROT_NONE);
  return base + body - nbytes;
}

}  // namespace

extern "C" void emu_threadgroup_barrier(int line) {
  Fiber* f = g_cur;
  if (g_done > 0) fail("threadgroup_barrier reached after some threads exited");
  f->state = AT_BARRIER;
  f->line = line;
  if (g_at_barrier == 0) {
    g_barrier_line = line;
  } else if (g_barrier_line != line) {
    fail("divergent threadgroup_barrier: threads wait at lines " +
         std::to_string(g_barrier_line) + " and " + std::to_string(line));
  }
  if (++g_at_barrier == g_live) {
    for (int i = 0; i < g_nthreads; ++i)
      if (g_fibers[i].state == AT_BARRIER) g_fibers[i].state = RUNNABLE;
    g_at_barrier = 0;
    f->state = RUNNABLE;
    return;
  }
  yield_to_scheduler();
}

extern "C" const EmuSimdView* emu_simd_exchange(int op, const void* value, int nbytes,
                                                 int line) {
  Fiber* f = g_cur;
  const uint32_t lane = f->ids.thread_index_in_simdgroup;
  const uint32_t s = f->ids.simdgroup_index_in_threadgroup;
  Simdgroup& sg = g_sgs[s];
  const int code = op * 16 + nbytes;
  if (sg.arrived == 0) {
    sg.op = code;
    sg.line = line;
    sg.mask = 0;
  } else if (sg.op != code || sg.line != line) {
    fail("divergent SIMD-group ops in simdgroup " + std::to_string(s) + " (lines " +
         std::to_string(sg.line) + " and " + std::to_string(line) + ")");
  }
  sg.slots[lane] = 0;
  if (nbytes > 0) std::memcpy(&sg.slots[lane], value, size_t(nbytes));
  sg.mask |= 1u << lane;
  f->state = AT_SIMD;
  if (++sg.arrived == sg.live) {
    release_simdgroup(s);
    return &f->view;
  }
  yield_to_scheduler();
  return &f->view;
}

extern "C" void* emu_threadgroup_alloc(int site, unsigned long size, unsigned long align) {
  for (const Site& s : g_sites) {
    if (s.site == site) {
      if (s.size != size) fail("threadgroup variable changed size");
      return g_tg_mem + s.offset;
    }
  }
  size_t off = (g_tg_used + align - 1) / align * align;
  if (off + size > kThreadgroupMemory) fail("threadgroup memory exceeds 32 KiB");
  g_sites.push_back(Site{site, off, size});
  g_tg_used = off + size;
  return g_tg_mem + off;
}

extern "C" void emu_fail(const char* message) { fail(message); }

int main(int argc, char** argv) {
  if (argc != 3) fail("usage: kernel LAUNCH_FILE OUTPUT_FILE");
  static char altstack[1 << 16];
  stack_t ss{};
  ss.ss_sp = altstack;
  ss.ss_size = sizeof(altstack);
  sigaltstack(&ss, nullptr);
  struct sigaction sa {};
  sa.sa_handler = on_segv;
  sa.sa_flags = SA_ONSTACK;
  sigaction(SIGSEGV, &sa, nullptr);
  sigaction(SIGBUS, &sa, nullptr);
  sigaction(SIGFPE, &sa, nullptr);

  std::vector<char> in = read_file(argv[1]);
  size_t pos = 0;
  auto take = [&](void* dst, size_t n) {
    if (pos + n > in.size()) fail("truncated launch file");
    std::memcpy(dst, in.data() + pos, n);
    pos += n;
  };
  char magic[8];
  take(magic, 8);
  if (std::memcmp(magic, "DFEMU01", 8) != 0) fail("bad launch file");
  int grid[3], tg[3], nsched, nbuf, nin;
  take(grid, sizeof(grid));
  take(tg, sizeof(tg));
  take(&nsched, 4);
  std::vector<int> scheds(static_cast<size_t>(nsched));
  take(scheds.data(), 4 * size_t(nsched));
  uint32_t seed;
  take(&seed, 4);
  take(&nbuf, 4);
  take(&nin, 4);
  std::vector<EmuBuffer> bufs(static_cast<size_t>(nbuf));
  std::vector<std::vector<int32_t>> shapes(static_cast<size_t>(nbuf));
  std::vector<std::vector<int64_t>> strides(static_cast<size_t>(nbuf));
  std::vector<std::vector<char>> initial(static_cast<size_t>(nbuf));
  for (int i = 0; i < nbuf; ++i) {
    int32_t ndim;
    take(&ndim, 4);
    shapes[i].resize(size_t(ndim) + 1);
    strides[i].resize(size_t(ndim) + 1);
    take(shapes[i].data(), 4 * size_t(ndim));
    take(strides[i].data(), 8 * size_t(ndim));
    int64_t nbytes;
    take(&nbytes, 8);
    initial[i].resize(size_t(nbytes));
    take(initial[i].data(), size_t(nbytes));
    bufs[i] = EmuBuffer{guarded_alloc(size_t(nbytes)), shapes[i].data(), strides[i].data(), ndim};
    std::memcpy(bufs[i].data, initial[i].data(), size_t(nbytes));
  }
  if (tg[0] * tg[1] * tg[2] > kMaxThreads) fail("threadgroup larger than 1024 threads");
  for (Fiber& f : g_fibers) {  // stacks with a guard page below
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    char* m = static_cast<char*>(mmap(nullptr, kStack + page, PROT_READ | PROT_WRITE,
                                      MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    if (m == MAP_FAILED) fail("mmap failed");
    mprotect(m, page, PROT_NONE);
    f.stack = m + page;
  }
  g_buffers = bufs.data();

  FILE* out = std::fopen(argv[2], "wb");
  if (!out) fail("cannot write output file");
  uint32_t ntg[3];
  for (int d = 0; d < 3; ++d) ntg[d] = (uint32_t(grid[d]) + tg[d] - 1) / uint32_t(tg[d]);
  for (int sched : scheds) {
    uint32_t rng = seed ? seed : 0x9e3779b9u;
    for (int i = nin; i < nbuf; ++i)
      std::memcpy(bufs[i].data, initial[i].data(), initial[i].size());
    uint32_t p[3];
    for (p[2] = 0; p[2] < ntg[2]; ++p[2])
      for (p[1] = 0; p[1] < ntg[1]; ++p[1])
        for (p[0] = 0; p[0] < ntg[0]; ++p[0]) run_threadgroup(p, grid, tg, sched, &rng);
    for (int i = nin; i < nbuf; ++i) std::fwrite(bufs[i].data, 1, initial[i].size(), out);
  }
  std::fclose(out);
  return 0;
}
