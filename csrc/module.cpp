// The Python module object for gptfast_kernels._C. Importing it runs the static
// TORCH_LIBRARY registrations in the other translation units; it exports no Python functions
// (every op is reached through torch.ops.gptfast_kernels), so it needs only the limited C API.
#include <Python.h>

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
