// The Python module `patchgemm._C`: importing it loads this library, which runs the op
// registrations (registration.cpp and the TORCH_LIBRARY_IMPL blocks). No pybind11 and no functions,
// built against the stable ABI. The only Python-specific source; the C++ microbenchmarks
// (bench/cpp) link everything else.
#include <Python.h>

extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
