// The Python module object for gptfast_kernels._C. Importing it runs the static
// TORCH_LIBRARY registrations in the other translation units; it exports no Python functions
// (every op is reached through torch.ops.gptfast_kernels), so it needs only the limited C API.
#include <Python.h>

#ifdef GPTFAST_PORTABLE_GLIBC
// Only in the build carried to the GPU machine (scripts/build_for_gpu_machine.sh), whose image may
// have an older glibc than this machine: libstdc++'s headers from GCC 11 on read glibc 2.32's
// __libc_single_threaded wherever <sys/single_threaded.h> exists at build time, which made that
// build ask for GLIBC_2.32 (torch itself asks for 2.28). Defined here, the reference binds without
// glibc: where glibc has its own, the loader still picks glibc's; where not, this one says "threads
// may exist", so shared pointers keep their atomic counts, as libstdc++ does without the variable.
extern "C" {
char __libc_single_threaded = 0;
}
#endif

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "_C",  // name
      "gptfast_kernels compiled kernels; use torch.ops.gptfast_kernels",
      -1,    // no per-module state
      nullptr,
  };
  return PyModule_Create(&module_def);
}
}
