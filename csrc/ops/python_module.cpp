// The Python module `patchgemm._C`: importing it loads this library, which runs the op
// registrations (registration.cpp and the TORCH_LIBRARY_IMPL blocks). No pybind11, built against
// the stable ABI; its one function is a plain C call because it runs on every call of the ops that
// cache settled choices (patchgemm/selection.py), where an op call through the dispatcher would cost
// more than it saves. The only Python-specific source; the C++ microbenchmarks (bench/cpp) link
// everything else.
#include <Python.h>

#include <cstdint>

namespace patchgemm::selection {
int64_t settled_choices_version();  // selection/registry.h
}

namespace {

PyObject* settled_choices_version(PyObject*, PyObject*) {
  return PyLong_FromLongLong(patchgemm::selection::settled_choices_version());
}

PyMethodDef methods[] = {
    {"settled_choices_version", settled_choices_version, METH_NOARGS,
     "A number that changes whenever a settled choice may change; -1 while choices are observed."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  return PyModule_Create(&module);
}
