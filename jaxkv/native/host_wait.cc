// jaxkv host_wait ops: device calls that meet a host thread through counters in pinned host memory.
//
// A slot (slot id, device ordinal) names a u32 counter and the device's bytes of an array, both in pinned host
// memory; each execution of an op on a device counts its slot's executions, k = 1, 2, ...
//   jaxkv_host_wait:    waits until the counter reaches k (the host raises it once it has written the bytes), then
//                       copies the bytes into the call's output.
//   jaxkv_host_publish: copies the call's operand into the bytes, then sets the counter to k (the host polls it).
// So a call can be dispatched before its input exists and starts as soon as the host's counter moves, and the host
// sees a result without asking the runtime, with no thread dispatching anything in between (jaxkv.host.wait).
//
// CUDA: one block of a small kernel on the call's stream does it, reading and writing the host memory through its
// device address (the kernels below, PTX: nvcc -ptx -arch=compute_80; their CUDA source is in jaxkv.host.wait).
// A kernel, not the stream's own wait (cuStreamWaitValue32) and a cuMemcpy: the copy engines run the copies FIFO,
// so a small copy waited behind the host-to-device copies in flight (2.7-2.9 ms on the H200 beside back-to-back
// 256 MiB puts, against 0.17-0.20 ms for the kernel).
// CPU: the call's thread polls the counter or stores it (for the tests; the CPU has no stream).
#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kSlots = 64;
constexpr int kDevices = 64;
constexpr int kCpuTimeoutS = 300;  // The CPU's wait gives up (an error) after this; a CUDA kernel cannot.

struct Slot {
  uint32_t* counter = nullptr;  // Pinned host.
  void* bytes_at = nullptr;     // This device's bytes (pinned host).
  uint64_t bytes = 0;
  uint32_t issued = 0;  // Executions so far.
};

std::mutex mu;
Slot slots[kSlots][kDevices];

ffi::Error Take(int64_t slot, int32_t device, size_t bytes, Slot* s, uint32_t* k) {
  if (slot < 0 || slot >= kSlots || device < 0 || device >= kDevices) {
    return ffi::Error::InvalidArgument("jaxkv host_wait: slot " + std::to_string(slot) + " or device " +
                                       std::to_string(device) + " out of range");
  }
  std::lock_guard<std::mutex> lock(mu);
  Slot& reg = slots[slot][device];
  if (reg.counter == nullptr) {
    return ffi::Error::InvalidArgument("jaxkv host_wait: slot " + std::to_string(slot) + " has no entry for device " +
                                       std::to_string(device));
  }
  if (reg.bytes != bytes || bytes % 4) {
    return ffi::Error::InvalidArgument("jaxkv host_wait: the slot holds " + std::to_string(reg.bytes) +
                                       " bytes, the call " + std::to_string(bytes));
  }
  *k = ++reg.issued;
  *s = reg;
  return ffi::Error::Success();
}

// The CUDA driver API, declared here: no CUDA headers are needed to build.
struct CUstream_st;
using CUstream = CUstream_st*;
struct CUmod_st;
using CUmodule = CUmod_st*;
struct CUfunc_st;
using CUfunction = CUfunc_st*;
using CUresult = int;

const char kPtx[] = R"ptx(.version 7.0
.target sm_80
.address_size 64
.visible .entry jaxkv_wait_copy(
	.param .u64 jaxkv_wait_copy_param_0,
	.param .u32 jaxkv_wait_copy_param_1,
	.param .u64 jaxkv_wait_copy_param_2,
	.param .u64 jaxkv_wait_copy_param_3,
	.param .u64 jaxkv_wait_copy_param_4
)
{
	.reg .pred 	%p<5>;
	.reg .b32 	%r<7>;
	.reg .b64 	%rd<15>;
	ld.param.u64 	%rd7, [jaxkv_wait_copy_param_0];
	ld.param.u32 	%r2, [jaxkv_wait_copy_param_1];
	ld.param.u64 	%rd8, [jaxkv_wait_copy_param_2];
	ld.param.u64 	%rd9, [jaxkv_wait_copy_param_3];
	ld.param.u64 	%rd10, [jaxkv_wait_copy_param_4];
	mov.u32 	%r1, %tid.x;
	setp.ne.s32 	%p1, %r1, 0;
	@%p1 bra 	$L__BB0_3;
	cvta.to.global.u64 	%rd1, %rd7;
$L__BB0_2:
	ld.volatile.global.u32 	%r3, [%rd1];
	sub.s32 	%r4, %r3, %r2;
	setp.lt.s32 	%p2, %r4, 0;
	@%p2 bra 	$L__BB0_2;
$L__BB0_3:
	bar.sync 	0;
	cvt.u64.u32 	%rd14, %r1;
	setp.ge.u64 	%p3, %rd14, %rd10;
	@%p3 bra 	$L__BB0_6;
	mov.u32 	%r5, %ntid.x;
	cvt.u64.u32 	%rd3, %r5;
	cvta.to.global.u64 	%rd4, %rd9;
$L__BB0_5:
	shl.b64 	%rd12, %rd14, 2;
	add.s64 	%rd11, %rd8, %rd12;
	ld.global.cv.u32 %r6, [%rd11];
	add.s64 	%rd13, %rd4, %rd12;
	st.global.u32 	[%rd13], %r6;
	add.s64 	%rd14, %rd14, %rd3;
	setp.lt.u64 	%p4, %rd14, %rd10;
	@%p4 bra 	$L__BB0_5;
$L__BB0_6:
	ret;
}
.visible .entry jaxkv_publish(
	.param .u64 jaxkv_publish_param_0,
	.param .u64 jaxkv_publish_param_1,
	.param .u64 jaxkv_publish_param_2,
	.param .u64 jaxkv_publish_param_3,
	.param .u32 jaxkv_publish_param_4
)
{
	.reg .pred 	%p<4>;
	.reg .b32 	%r<6>;
	.reg .b64 	%rd<15>;
	ld.param.u64 	%rd6, [jaxkv_publish_param_0];
	ld.param.u64 	%rd7, [jaxkv_publish_param_1];
	ld.param.u64 	%rd8, [jaxkv_publish_param_2];
	ld.param.u64 	%rd9, [jaxkv_publish_param_3];
	ld.param.u32 	%r1, [jaxkv_publish_param_4];
	mov.u32 	%r2, %tid.x;
	cvt.u64.u32 	%rd1, %r2;
	setp.ge.u64 	%p1, %rd1, %rd8;
	@%p1 bra 	$L__BB0_3;
	mov.u32 	%r3, %ntid.x;
	cvt.u64.u32 	%rd2, %r3;
	cvta.to.global.u64 	%rd3, %rd6;
	mov.u64 	%rd14, %rd1;
$L__BB0_2:
	shl.b64 	%rd11, %rd14, 2;
	add.s64 	%rd12, %rd3, %rd11;
	ld.global.u32 	%r4, [%rd12];
	add.s64 	%rd10, %rd7, %rd11;
	st.global.cs.u32 [%rd10], %r4;
	add.s64 	%rd14, %rd14, %rd2;
	setp.lt.u64 	%p2, %rd14, %rd8;
	@%p2 bra 	$L__BB0_2;
$L__BB0_3:
	cvt.u32.u64 	%r5, %rd1;
	membar.sys;
	bar.sync 	0;
	setp.ne.s32 	%p3, %r5, 0;
	@%p3 bra 	$L__BB0_5;
	cvta.to.global.u64 	%rd13, %rd9;
	st.volatile.global.u32 	[%rd13], %r1;
$L__BB0_5:
	ret;
})ptx";

struct Driver {
  CUresult (*module_load)(CUmodule*, const void*) = nullptr;
  CUresult (*get_function)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                     void**, void**) = nullptr;
  CUresult (*error_string)(CUresult, const char**) = nullptr;
};

const Driver& driver() {
  static const Driver d = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib != nullptr) {
      d.module_load = reinterpret_cast<decltype(d.module_load)>(dlsym(lib, "cuModuleLoadData"));
      d.get_function = reinterpret_cast<decltype(d.get_function)>(dlsym(lib, "cuModuleGetFunction"));
      d.launch = reinterpret_cast<decltype(d.launch)>(dlsym(lib, "cuLaunchKernel"));
      d.error_string = reinterpret_cast<decltype(d.error_string)>(dlsym(lib, "cuGetErrorString"));
    }
    return d;
  }();
  return d;
}

ffi::Error CudaError(const char* what, CUresult r) {
  const char* text = "unknown";
  if (driver().error_string != nullptr) driver().error_string(r, &text);
  return ffi::Error::Internal(std::string("jaxkv host_wait: ") + what + " failed: " + text + " (" +
                              std::to_string(r) + ")");
}

// Kernel `which` of kPtx (0 jaxkv_wait_copy, 1 jaxkv_publish) on `device`; its module is loaded once, in the context
// current when XLA runs the call.
ffi::Error Kernel(int32_t device, int which, CUfunction* fn) {
  static CUfunction fns[kDevices][2];
  const Driver& d = driver();
  if (d.module_load == nullptr || d.get_function == nullptr || d.launch == nullptr) {
    return ffi::Error::Internal("jaxkv host_wait: cuModuleLoadData, cuModuleGetFunction or cuLaunchKernel missing");
  }
  std::lock_guard<std::mutex> lock(mu);
  if (fns[device][0] == nullptr) {
    CUmodule m;
    if (CUresult r = d.module_load(&m, kPtx); r != 0) return CudaError("cuModuleLoadData", r);
    if (CUresult r = d.get_function(&fns[device][0], m, "jaxkv_wait_copy"); r != 0) {
      return CudaError("cuModuleGetFunction", r);
    }
    if (CUresult r = d.get_function(&fns[device][1], m, "jaxkv_publish"); r != 0) {
      return CudaError("cuModuleGetFunction", r);
    }
  }
  *fn = fns[device][which];
  return ffi::Error::Success();
}

ffi::Error Launch(CUfunction fn, CUstream stream, void** params) {
  if (CUresult r = driver().launch(fn, 1, 1, 1, 1024, 1, 1, 0, stream, params, nullptr); r != 0) {
    return CudaError("cuLaunchKernel", r);
  }
  return ffi::Error::Success();
}

ffi::Error WaitCuda(CUstream stream, int32_t device, int64_t slot, ffi::Result<ffi::AnyBuffer> out) {
  Slot s;
  uint32_t k;
  CUfunction fn;
  if (ffi::Error e = Take(slot, device, out->size_bytes(), &s, &k); e.failure()) return e;
  if (ffi::Error e = Kernel(device, 0, &fn); e.failure()) return e;
  void* dst = out->untyped_data();
  unsigned long long words = s.bytes / 4;
  void* params[] = {&s.counter, &k, &s.bytes_at, &dst, &words};
  return Launch(fn, stream, params);
}

ffi::Error PublishCuda(CUstream stream, int32_t device, int64_t slot, ffi::AnyBuffer in,
                       ffi::Result<ffi::AnyBuffer> out) {
  Slot s;
  uint32_t k;
  CUfunction fn;
  if (ffi::Error e = Take(slot, device, in.size_bytes(), &s, &k); e.failure()) return e;
  if (ffi::Error e = Kernel(device, 1, &fn); e.failure()) return e;
  void* src = in.untyped_data();
  unsigned long long words = s.bytes / 4;
  void* params[] = {&src, &s.bytes_at, &words, &s.counter, &k};
  return Launch(fn, stream, params);
}

ffi::Error WaitCpu(int32_t device, int64_t slot, ffi::Result<ffi::AnyBuffer> out) {
  Slot s;
  uint32_t k;
  if (ffi::Error e = Take(slot, device, out->size_bytes(), &s, &k); e.failure()) return e;
  auto counter = reinterpret_cast<std::atomic<uint32_t>*>(s.counter);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kCpuTimeoutS);
  while (static_cast<int32_t>(counter->load(std::memory_order_acquire) - k) < 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      return ffi::Error::Internal("jaxkv host_wait: no signal from the host in " + std::to_string(kCpuTimeoutS) + " s");
    }
    std::this_thread::yield();
  }
  std::memcpy(out->untyped_data(), s.bytes_at, s.bytes);
  return ffi::Error::Success();
}

ffi::Error PublishCpu(int32_t device, int64_t slot, ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out) {
  Slot s;
  uint32_t k;
  if (ffi::Error e = Take(slot, device, in.size_bytes(), &s, &k); e.failure()) return e;
  std::memcpy(s.bytes_at, in.untyped_data(), s.bytes);
  reinterpret_cast<std::atomic<uint32_t>*>(s.counter)->store(k, std::memory_order_release);
  return ffi::Error::Success();
}

}  // namespace

// jaxkv_host_publish's result is its operand (aliased by the caller): the copy to the host leaves it as it is.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvHostWaitCuda, WaitCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("slot")
                                  .Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvHostPublishCuda, PublishCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("slot")
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvHostWaitCpu, WaitCpu,
                              ffi::Ffi::Bind().Ctx<ffi::DeviceOrdinal>().Attr<int64_t>("slot").Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxkvHostPublishCpu, PublishCpu,
    ffi::Ffi::Bind().Ctx<ffi::DeviceOrdinal>().Attr<int64_t>("slot").Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());

// Sets (or, with counter null, clears) a slot's entry for one device, and its count of executions to 0.
extern "C" void jaxkv_host_wait_set(int64_t slot, int32_t device, void* counter, void* bytes_at, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu);
  slots[slot][device] = Slot{static_cast<uint32_t*>(counter), bytes_at, bytes, 0};
}

// Spins until (int32)(counters[i] - k) >= 0 for every i < n (returns 1) or timeout_s passes (returns 0). The host's
// side of jaxkv_host_publish; through ctypes, which releases the GIL, so the other Python threads run meanwhile.
extern "C" int jaxkv_host_wait_poll(const uint32_t* counters, int n, uint32_t k, double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (uint64_t i = 1;; ++i) {
    bool all = true;
    for (int j = 0; j < n; ++j) {
      uint32_t c = reinterpret_cast<const std::atomic<uint32_t>*>(counters + j)->load(std::memory_order_acquire);
      all = all && static_cast<int32_t>(c - k) >= 0;
    }
    if (all) return 1;
    if (i % 4096 == 0 && std::chrono::steady_clock::now() > deadline) return 0;
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
}

extern "C" int jaxkv_host_wait_limits(int which) { return which == 0 ? kSlots : kDevices; }
