/* The hot path of an ordinary call, in C: check the numpy arguments
 * against their expected shapes and dtype, bind the symbolic dimensions,
 * allocate the outputs, run the generated function through its packed
 * entry point, turn scalar outputs into Python floats.
 *
 * The patterns come from the binder (symbackprop/binding.py), and this
 * accepts a subset of what the binder accepts: exact arrays of the right
 * dtype, C-contiguous and aligned, every symbolic dimension >= 1 in every
 * array that has it and equal across them, and for a scalar a Python float
 * (or a subclass: numpy's float64), an int that fits int64 (not a bool) or
 * a 0-d array of the right dtype,
 * converted as numpy converts it. The arguments come as a list in C order,
 * or as the dict of keyword arguments (looked up by the names given). Anything else returns None
 * without raising: the caller then takes the binder's path, which converts
 * what it can and names what is wrong. A nonzero status of the generated
 * function is returned as an int for the same reason. A Caller given a
 * fallback calls it with the arguments instead, and returns what it returns.
 *
 * The outputs come back as a list in C order, or, for a Caller given a
 * layout, shaped as the module's method returns them (function.py's
 * Function.layout: an int is that output, a dict {key: int} a dict of
 * outputs, a tuple of layouts a tuple). A scalar output is written on this
 * call's stack and returned as a Python float: no array is made for it
 * (a call of a scalar model spent a third of its time on those). Built with the
 * package where it is installed (setup.py), else on first use by
 * symbackprop.run.fastcall and cached.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

typedef int (*entry_fn)(const int64_t *dims, void *const *arrays);
typedef size_t (*work_len_fn)(const int64_t *dims);

enum { MAX_DIMS = 64 };

/* A fixed size as itself (> 0), symbolic dimension k as -(k + 1). */
typedef struct {
    npy_intp rows, cols;
    int type;
    int scalar; /* inputs: a number is accepted; outputs: returned as a Python float */
} Pattern;

typedef struct {
    PyObject_HEAD
    entry_fn entry;
    work_len_fn work_len;
    int n_dims, n_inputs, n_outputs, itemsize;
    Pattern *patterns; /* inputs, then outputs */
    PyObject *names;   /* the inputs' names in C order (a tuple), or NULL: lists only */
    PyObject *layout;   /* how the outputs are returned (see above), or NULL: a list */
    PyObject *fallback; /* called with the arguments where this declines or the status is nonzero, or NULL */
} Caller;

/* Scratch memory per thread, shared by every module: generated functions
 * never call back into Python, so one call at a time uses it. A pthread
 * key's destructor frees it when the thread ends. */
static pthread_key_t scratch_key;

/* numpy's threshold for asking for huge pages, and their size on x86-64 and arm64 */
#define HUGE_SCRATCH_BYTES ((size_t)4 << 20)
#define HUGE_PAGE_BYTES ((size_t)2 << 20)

typedef struct {
    void *data;
    size_t bytes;
} Scratch;

static void free_scratch(void *pointer)
{
    Scratch *s = pointer;
    if (s != NULL) {
        free(s->data);
        free(s);
    }
}

static void *scratch(size_t bytes)
{
    Scratch *s = pthread_getspecific(scratch_key);
    if (s == NULL) {
        s = calloc(1, sizeof *s);
        if (s == NULL || pthread_setspecific(scratch_key, s) != 0) {
            free(s);
            return NULL;
        }
    }
    if (s->bytes < bytes) {
        /* Large scratch on huge pages where the kernel grants them on request
         * (transparent huge pages in "madvise" mode), as numpy does for its
         * large arrays: a transformer step's workspace on 4 KiB pages ran
         * 15% slower than the same step on a numpy workspace (TLB misses). */
        size_t align = bytes >= HUGE_SCRATCH_BYTES ? HUGE_PAGE_BYTES : 64;
        size_t rounded = (bytes + align - 1) / align * align;
        void *data = aligned_alloc(align, rounded);
        if (data == NULL) {
            return NULL;
        }
#ifdef MADV_HUGEPAGE
        if (align == HUGE_PAGE_BYTES) {
            (void)madvise(data, rounded, MADV_HUGEPAGE); /* a hint: refused, the pages stay small */
        }
#endif
        free(s->data);
        s->data = data;
        s->bytes = rounded;
    }
    return s->data;
}

static int bind(npy_intp want, npy_intp got, int64_t *dims)
{
    if (want > 0) {
        return want == got;
    }
    if (got < 1) {
        return 0; /* an empty array: the binder names it */
    }
    int64_t *dim = &dims[-want - 1];
    if (*dim == 0) {
        *dim = got;
        return 1;
    }
    return *dim == got;
}

static npy_intp resolve(npy_intp size, const int64_t *dims)
{
    return size > 0 ? size : (npy_intp)dims[-size - 1];
}

/* A Python number for a scalar input, written into `slot` in the input's
 * type; 0 to decline (the binder converts or explains), as numpy would:
 * a float as is, an int through int64, a float32 rounded to nearest. */
static int number(PyObject *item, int type, double *slot)
{
    double value;
    if (PyFloat_Check(item)) {
        value = PyFloat_AS_DOUBLE(item);
    } else if (PyLong_CheckExact(item)) {
        int overflow;
        long long whole = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow || (whole == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return 0;
        }
        value = (double)whole;
    } else {
        return 0;
    }
    if (type == NPY_DOUBLE) {
        *slot = value;
        return 1;
    }
    float narrow = (float)value;
    if (type != NPY_FLOAT || (isfinite(value) && !isfinite(narrow))) {
        return 0; /* numpy warns of the overflow: the binder's path */
    }
    memcpy(slot, &narrow, sizeof narrow);
    return 1;
}

/* Input k of a list in C order or of the keyword arguments; NULL to decline. */
static PyObject *argument(const Caller *self, PyObject *values, int k)
{
    if (PyList_CheckExact(values)) {
        return PyList_GET_ITEM(values, k);
    }
    PyObject *item = PyDict_GetItemWithError(values, PyTuple_GET_ITEM(self->names, k));
    if (item == NULL) {
        PyErr_Clear();
    }
    return item;
}

static void release(PyObject **results, int count);
static PyObject *declined(const Caller *self, PyObject *values, int status);
static PyObject *returned(const Caller *self, PyObject **results);
static PyObject *shaped(PyObject *layout, PyObject *const *results);

static PyObject *Caller_call(Caller *self, PyObject *args, PyObject *kwargs)
{
    PyObject *values;
    if (kwargs != NULL || !PyArg_UnpackTuple(args, "Caller", 1, 1, &values)) {
        PyErr_SetString(PyExc_TypeError, "a Caller takes one list of arrays");
        return NULL;
    }
    if (self->entry == NULL) {
        PyErr_SetString(PyExc_TypeError, "an uninitialized Caller");
        return NULL;
    }
    if (PyDict_CheckExact(values)) {
        if (self->names == NULL || PyDict_GET_SIZE(values) != self->n_inputs) {
            return declined(self, values, 0); /* every name found and no other: the binder names what is missing or unknown */
        }
    } else if (self->fallback != NULL) {
        return declined(self, values, 0); /* (a mapping of another type, say: the fallback's to take or explain) */
    } else if (!PyList_CheckExact(values) || PyList_GET_SIZE(values) != self->n_inputs) {
        PyErr_SetString(PyExc_TypeError, "a Caller takes one list of its inputs or the dict of them by name");
        return NULL;
    }
    int64_t dims[MAX_DIMS] = {0};
    void *pointers[self->n_inputs + self->n_outputs + 1]; /* on this call's stack: threads share the Caller */
    double numbers[self->n_inputs + 1];                    /* scalars given as Python numbers */
    for (int k = 0; k < self->n_inputs; ++k) {
        PyObject *item = argument(self, values, k);
        const Pattern *p = &self->patterns[k];
        if (item == NULL) {
            return declined(self, values, 0);
        }
        if (!PyArray_CheckExact(item)) {
            if (!p->scalar || !number(item, p->type, &numbers[k])) {
                return declined(self, values, 0);
            }
            pointers[k] = &numbers[k];
            continue;
        }
        PyArrayObject *array = (PyArrayObject *)item;
        /* an Index (int64) may be 1-D: a column of row numbers */
        int ndim = PyArray_NDIM(array), column = ndim == 1 && p->type == NPY_INT64 && p->cols == 1;
        if (ndim == 0 && p->scalar) { /* a 0-d array for a scalar: its one element, as (1, 1) */
            if (PyArray_TYPE(array) != p->type || PyArray_ISBYTESWAPPED(array) ||
                !PyArray_CHKFLAGS(array, NPY_ARRAY_ALIGNED)) {
                return declined(self, values, 0);
            }
            pointers[k] = PyArray_DATA(array);
            continue;
        }
        if (PyArray_TYPE(array) != p->type || (ndim != 2 && !column) || PyArray_ISBYTESWAPPED(array) ||
            !PyArray_CHKFLAGS(array, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED)) {
            return declined(self, values, 0);
        }
        const npy_intp *shape = PyArray_DIMS(array);
        if (!bind(p->rows, shape[0], dims) || !bind(p->cols, column ? 1 : shape[1], dims)) {
            return declined(self, values, 0);
        }
        pointers[k] = PyArray_DATA(array);
    }
    for (int d = 0; d < self->n_dims; ++d) {
        if (dims[d] < 1) {
            return declined(self, values, 0); /* not fixed by any argument */
        }
    }
    PyObject *results[self->n_outputs + 1];
    union { double d; float f; } scalars[self->n_outputs + 1]; /* scalar outputs, in the module's real type */
    for (int k = 0; k < self->n_outputs; ++k) {
        const Pattern *p = &self->patterns[self->n_inputs + k];
        results[k] = NULL;
        if (p->scalar) {
            pointers[self->n_inputs + k] = &scalars[k];
            continue;
        }
        npy_intp shape[2] = {resolve(p->rows, dims), resolve(p->cols, dims)};
        if ((results[k] = PyArray_SimpleNew(2, shape, p->type)) == NULL) {
            release(results, k);
            return NULL;
        }
        pointers[self->n_inputs + k] = PyArray_DATA((PyArrayObject *)results[k]);
    }
    size_t work = self->work_len(dims);
    void *memory = scratch((work ? work : 1) * (size_t)self->itemsize);
    if (memory == NULL) {
        release(results, self->n_outputs);
        return PyErr_NoMemory();
    }
    pointers[self->n_inputs + self->n_outputs] = memory;
    int status;
    entry_fn entry = self->entry;
    Py_BEGIN_ALLOW_THREADS
    status = entry(dims, pointers);
    Py_END_ALLOW_THREADS
    if (status != 0) {
        release(results, self->n_outputs);
        return declined(self, values, status);
    }
    for (int k = 0; k < self->n_outputs; ++k) {
        const Pattern *p = &self->patterns[self->n_inputs + k];
        if (p->scalar) {
            double value = p->type == NPY_FLOAT ? (double)scalars[k].f : scalars[k].d;
            if ((results[k] = PyFloat_FromDouble(value)) == NULL) {
                release(results, self->n_outputs);
                return NULL;
            }
        }
    }
    return returned(self, results);
}

/* Drops the first `count` results (NULL: not made). */
static void release(PyObject **results, int count)
{
    for (int k = 0; k < count; ++k) {
        Py_XDECREF(results[k]);
    }
}

/* What a declined call (status 0) or a nonzero status returns. */
static PyObject *declined(const Caller *self, PyObject *values, int status)
{
    if (self->fallback != NULL) {
        return PyObject_CallOneArg(self->fallback, values);
    }
    if (status != 0) {
        return PyLong_FromLong(status);
    }
    Py_RETURN_NONE;
}

/* The results (owned: dropped here) as a list, or shaped by the layout. */
static PyObject *returned(const Caller *self, PyObject **results)
{
    PyObject *out;
    if (self->layout == NULL) {
        if ((out = PyList_New(self->n_outputs)) != NULL) {
            for (int k = 0; k < self->n_outputs; ++k) {
                PyList_SET_ITEM(out, k, results[k]); /* steals */
            }
            return out;
        }
    } else {
        out = shaped(self->layout, results);
    }
    release(results, self->n_outputs);
    return out;
}

/* A layout (checked by layout_ok) filled in with new references to the results. */
static PyObject *shaped(PyObject *layout, PyObject *const *results)
{
    if (PyLong_CheckExact(layout)) {
        PyObject *item = results[PyLong_AsSsize_t(layout)];
        Py_INCREF(item);
        return item;
    }
    if (PyDict_CheckExact(layout)) {
        PyObject *out = PyDict_New(), *key, *index;
        Py_ssize_t position = 0;
        while (out != NULL && PyDict_Next(layout, &position, &key, &index)) {
            if (PyDict_SetItem(out, key, results[PyLong_AsSsize_t(index)]) < 0) {
                Py_CLEAR(out);
            }
        }
        return out;
    }
    Py_ssize_t count = PyTuple_GET_SIZE(layout);
    PyObject *out = PyTuple_New(count);
    for (Py_ssize_t k = 0; out != NULL && k < count; ++k) {
        PyObject *part = shaped(PyTuple_GET_ITEM(layout, k), results);
        if (part == NULL) {
            Py_CLEAR(out);
        } else {
            PyTuple_SET_ITEM(out, k, part);
        }
    }
    return out;
}

/* 1 where every int of the layout names an output and it is made of ints, dicts of them and tuples. */
static int layout_ok(PyObject *layout, int n_outputs)
{
    if (PyLong_CheckExact(layout)) {
        Py_ssize_t index = PyLong_AsSsize_t(layout);
        return index >= 0 && index < n_outputs;
    }
    if (PyDict_CheckExact(layout)) {
        PyObject *key, *index;
        Py_ssize_t position = 0;
        while (PyDict_Next(layout, &position, &key, &index)) {
            if (!PyLong_CheckExact(index) || !layout_ok(index, n_outputs)) {
                return 0;
            }
        }
        return 1;
    }
    if (!PyTuple_CheckExact(layout)) {
        return 0;
    }
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(layout); ++k) {
        if (!layout_ok(PyTuple_GET_ITEM(layout, k), n_outputs)) {
            return 0;
        }
    }
    return 1;
}

static int read_patterns(PyObject *sequence, Pattern *into, Py_ssize_t count)
{
    for (Py_ssize_t k = 0; k < count; ++k) {
        PyObject *item = PyTuple_GetItem(sequence, k);
        if (item == NULL) {
            return -1;
        }
        long rows, cols;
        int type, scalar = 0;
        if (!PyArg_ParseTuple(item, "llip", &rows, &cols, &type, &scalar)) {
            return -1;
        }
        into[k] = (Pattern){rows, cols, type, scalar};
    }
    return 0;
}

static int Caller_init(Caller *self, PyObject *args, PyObject *kwargs)
{
    unsigned long long entry, work_len;
    int n_dims, itemsize;
    PyObject *inputs, *outputs, *names = NULL, *layout = Py_None, *fallback = Py_None;
    if (kwargs != NULL || !PyArg_ParseTuple(args, "KKiiO!O!|O!OO", &entry, &work_len, &n_dims, &itemsize,
                                            &PyTuple_Type, &inputs, &PyTuple_Type, &outputs, &PyTuple_Type, &names,
                                            &layout, &fallback)) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError,
                            "Caller(entry, work_len, n_dims, itemsize, inputs, outputs[, names[, layout, fallback]])");
        }
        return -1;
    }
    layout = layout == Py_None ? NULL : layout;
    fallback = fallback == Py_None ? NULL : fallback;
    if (fallback != NULL && !PyCallable_Check(fallback)) {
        PyErr_SetString(PyExc_TypeError, "Caller: the fallback must be callable");
        return -1;
    }
    if (n_dims < 0 || n_dims > MAX_DIMS || itemsize < 1) {
        PyErr_SetString(PyExc_ValueError, "Caller: bad n_dims or itemsize");
        return -1;
    }
    Py_ssize_t n_in = PyTuple_GET_SIZE(inputs), n_out = PyTuple_GET_SIZE(outputs);
    if (n_in + n_out > 4096) { /* fastcall.MAX_ARGUMENTS: the caller declines more */
        PyErr_SetString(PyExc_ValueError, "Caller: too many arguments");
        return -1;
    }
    PyMem_Free(self->patterns);
    self->patterns = PyMem_Calloc((size_t)(n_in + n_out) + 1, sizeof(Pattern));
    if (self->patterns == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (read_patterns(inputs, self->patterns, n_in) < 0 || read_patterns(outputs, self->patterns + n_in, n_out) < 0) {
        return -1;
    }
    if (names != NULL && PyTuple_GET_SIZE(names) != n_in) {
        PyErr_SetString(PyExc_ValueError, "Caller: one name per input");
        return -1;
    }
    for (Py_ssize_t k = 0; k < n_in + n_out; ++k) {
        const Pattern *p = &self->patterns[k];
        if (p->rows == 0 || p->cols == 0 || p->rows < -n_dims || p->cols < -n_dims) {
            PyErr_SetString(PyExc_ValueError, "Caller: a pattern names no size or a dimension out of range");
            return -1;
        }
        if (k >= n_in && p->scalar && (p->rows != 1 || p->cols != 1)) {
            PyErr_SetString(PyExc_ValueError, "Caller: a scalar output must be 1 x 1");
            return -1;
        }
    }
    if (layout != NULL && !layout_ok(layout, (int)n_out)) {
        PyErr_SetString(PyExc_ValueError, "Caller: a layout is an output's index, a dict of them or a tuple of layouts");
        return -1;
    }
    self->entry = (entry_fn)(uintptr_t)entry;
    self->work_len = (work_len_fn)(uintptr_t)work_len;
    self->n_dims = n_dims;
    self->n_inputs = (int)n_in;
    self->n_outputs = (int)n_out;
    self->itemsize = itemsize;
    Py_XINCREF(names);
    Py_XSETREF(self->names, names);
    Py_XINCREF(layout);
    Py_XSETREF(self->layout, layout);
    Py_XINCREF(fallback);
    Py_XSETREF(self->fallback, fallback);
    return 0;
}

/* The fallback is a method of the Function that holds this Caller: a cycle for the collector. */
static int Caller_traverse(Caller *self, visitproc visit, void *arg)
{
    Py_VISIT(self->names);
    Py_VISIT(self->layout);
    Py_VISIT(self->fallback);
    return 0;
}

static int Caller_clear(Caller *self)
{
    Py_CLEAR(self->names);
    Py_CLEAR(self->layout);
    Py_CLEAR(self->fallback);
    return 0;
}

static void Caller_dealloc(Caller *self)
{
    PyObject_GC_UnTrack(self);
    Caller_clear(self);
    PyMem_Free(self->patterns);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject CallerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "symbackprop_fastcall.Caller",
    .tp_basicsize = sizeof(Caller),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Caller(entry, work_len, n_dims, itemsize, inputs, outputs[, names[, layout, fallback]]): calls one "
              "generated function",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Caller_init,
    .tp_dealloc = (destructor)Caller_dealloc,
    .tp_traverse = (traverseproc)Caller_traverse,
    .tp_clear = (inquiry)Caller_clear,
    .tp_call = (ternaryfunc)Caller_call,
};

/* The data of a C-contiguous, aligned (and writeable, if asked) array, or NULL with a ValueError. */
static char *sweep_data(PyObject *object, int writeable, const char *what)
{
    if (!PyArray_Check(object) || !PyArray_ISCARRAY_RO((PyArrayObject *)object)
        || (writeable && !PyArray_ISWRITEABLE((PyArrayObject *)object))) {
        PyErr_Format(PyExc_ValueError, "sweep: %s must be a C-contiguous, aligned%s array", what,
                     writeable ? ", writeable" : "");
        return NULL;
    }
    return PyArray_DATA((PyArrayObject *)object);
}

/* The seed slots' arrays (writeable, all float64 or all float32): their data and entry counts, in
 * seeds[]/counts[], and their total entry count; -1 with a ValueError. */
static npy_intp sweep_seeds(PyObject *arrays_obj, PyObject *seed_slots_obj, char **seeds, npy_intp *counts, int *type)
{
    Py_ssize_t n_arrays = PyList_GET_SIZE(arrays_obj), n_seeds = PyTuple_GET_SIZE(seed_slots_obj);
    npy_intp total = 0;
    for (Py_ssize_t s = 0; s < n_seeds; ++s) {
        Py_ssize_t slot = PyLong_AsSsize_t(PyTuple_GET_ITEM(seed_slots_obj, s));
        if (slot < 0 || slot >= n_arrays) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_ValueError, "sweep: no such seed slot");
            }
            return -1;
        }
        PyObject *array = PyList_GET_ITEM(arrays_obj, slot);
        if ((seeds[s] = sweep_data(array, 1, "each seed")) == NULL) {
            return -1;
        }
        int this_type = PyArray_TYPE((PyArrayObject *)array);
        if ((this_type != NPY_DOUBLE && this_type != NPY_FLOAT) || (s > 0 && this_type != *type)) {
            PyErr_SetString(PyExc_ValueError, "sweep: the seeds must be all float64 or all float32");
            return -1;
        }
        *type = this_type;
        counts[s] = PyArray_SIZE((PyArrayObject *)array);
        total += counts[s];
    }
    return total;
}

/* Runs `function` once per one-hot seed: entry e of seed array s set to 1 and every other
 * seed entry 0, slot by slot; after each run copies each slots[k]'s array into the next
 * row of rows[k]. The first nonzero status stops it. */
static int sweep_runs(entry_fn function, int64_t *dims, void **pointers, char **seeds, npy_intp *counts,
                      Py_ssize_t n_seeds, int type, Py_ssize_t *slots, char **rows, size_t *sizes, Py_ssize_t n_rows)
{
    size_t itemsize = type == NPY_DOUBLE ? sizeof(double) : sizeof(float);
    int status = 0;
    size_t run = 0;
    for (Py_ssize_t s = 0; s < n_seeds; ++s) {
        memset(seeds[s], 0, (size_t)counts[s] * itemsize);
    }
    for (Py_ssize_t s = 0; s < n_seeds && status == 0; ++s) {
        for (npy_intp e = 0; e < counts[s] && status == 0; e++, run++) {
            if (e > 0) {
                memset(seeds[s] + (e - 1) * itemsize, 0, itemsize);
            }
            if (type == NPY_DOUBLE) {
                ((double *)seeds[s])[e] = 1.0;
            } else {
                ((float *)seeds[s])[e] = 1.0f;
            }
            status = function(dims, pointers);
            for (Py_ssize_t k = 0; k < n_rows && status == 0; k++) {
                memcpy(rows[k] + run * sizes[k], pointers[slots[k]], sizes[k]);
            }
        }
        memset(seeds[s], 0, (size_t)counts[s] * itemsize);
    }
    return status;
}

/* sweep(entry, dims, arrays, seed_slots, work, slots, rows): the generated
 * function once per one-hot seed, in one call from Python
 * (CompiledModule.jacobian: its vjp once per output entry, or its jvp once
 * per entry of every tangent). arrays: the function's inputs then outputs
 * (the workspace, the address `work`, comes last); the seeds run through
 * each entry of arrays[seed_slots[0]], then of the next seed slot's, the
 * other seed entries 0 (all are 0 again afterwards); after each run
 * arrays[slots[k]] is copied into the next row of rows[k] (an array of
 * seeds rows of its size). Returns 0, or the generated function's first
 * nonzero status. */
static PyObject *sweep(PyObject *module, PyObject *args)
{
    unsigned long long entry, work;
    PyObject *dims_obj, *arrays_obj, *seed_slots_obj, *slots_obj, *rows_obj;
    (void)module;
    if (!PyArg_ParseTuple(args, "KO!O!O!KO!O!", &entry, &PyTuple_Type, &dims_obj, &PyList_Type, &arrays_obj,
                          &PyTuple_Type, &seed_slots_obj, &work, &PyTuple_Type, &slots_obj, &PyTuple_Type, &rows_obj)) {
        return NULL;
    }
    Py_ssize_t n_dims = PyTuple_GET_SIZE(dims_obj), n_arrays = PyList_GET_SIZE(arrays_obj);
    Py_ssize_t n_rows = PyTuple_GET_SIZE(slots_obj), n_seeds = PyTuple_GET_SIZE(seed_slots_obj);
    if (n_dims > MAX_DIMS || n_seeds < 1 || PyTuple_GET_SIZE(rows_obj) != n_rows) {
        PyErr_SetString(PyExc_ValueError, "sweep: too many dimensions, no seed slot, or slots and rows disagree");
        return NULL;
    }
    int64_t dims[MAX_DIMS];
    for (Py_ssize_t d = 0; d < n_dims; ++d) {
        dims[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(dims_obj, d));
    }
    if (PyErr_Occurred()) {
        return NULL;
    }
    void **pointers = PyMem_Malloc((size_t)(n_arrays + 1) * sizeof(void *));
    char **rows = PyMem_Malloc((size_t)(n_rows + 1) * sizeof(char *));
    Py_ssize_t *slots = PyMem_Malloc((size_t)(n_rows + 1) * sizeof(Py_ssize_t));
    size_t *sizes = PyMem_Malloc((size_t)(n_rows + 1) * sizeof(size_t));
    char **seeds = PyMem_Malloc((size_t)n_seeds * sizeof(char *));
    npy_intp *counts = PyMem_Malloc((size_t)n_seeds * sizeof(npy_intp));
    PyObject *result = NULL;
    if (pointers == NULL || rows == NULL || slots == NULL || sizes == NULL || seeds == NULL || counts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < n_arrays; ++k) {
        if ((pointers[k] = sweep_data(PyList_GET_ITEM(arrays_obj, k), 0, "each argument")) == NULL) {
            goto done;
        }
    }
    pointers[n_arrays] = (void *)(uintptr_t)work;
    int type = NPY_DOUBLE;
    npy_intp runs = sweep_seeds(arrays_obj, seed_slots_obj, seeds, counts, &type);
    if (runs < 0) {
        goto done;
    }
    for (Py_ssize_t k = 0; k < n_rows; ++k) {
        slots[k] = PyLong_AsSsize_t(PyTuple_GET_ITEM(slots_obj, k));
        if (slots[k] < 0 || slots[k] >= n_arrays) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_ValueError, "sweep: no such slot");
            }
            goto done;
        }
        PyObject *row = PyTuple_GET_ITEM(rows_obj, k);
        sizes[k] = (size_t)PyArray_NBYTES((PyArrayObject *)PyList_GET_ITEM(arrays_obj, slots[k]));
        if ((rows[k] = sweep_data(row, 1, "each rows array")) == NULL) {
            goto done;
        }
        if ((size_t)PyArray_NBYTES((PyArrayObject *)row) != (size_t)runs * sizes[k]) {
            PyErr_SetString(PyExc_ValueError, "sweep: a rows array is not seeds times its slot's size");
            goto done;
        }
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = sweep_runs((entry_fn)(uintptr_t)entry, dims, pointers, seeds, counts, n_seeds, type, slots, rows, sizes,
                        n_rows);
    Py_END_ALLOW_THREADS
    result = PyLong_FromLong(status);
done:
    PyMem_Free(pointers);
    PyMem_Free(rows);
    PyMem_Free(slots);
    PyMem_Free(sizes);
    PyMem_Free(seeds);
    PyMem_Free(counts);
    return result;
}

static PyMethodDef methods[] = {
    {"sweep", sweep, METH_VARARGS, "sweep(...): the generated function once per one-hot seed (see _fastcall.c)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "symbackprop_fastcall", "The C hot path of ordinary calls.", -1, methods,
};

PyMODINIT_FUNC PyInit_symbackprop_fastcall(void)
{
    import_array();
    if (PyType_Ready(&CallerType) < 0) {
        return NULL;
    }
    if (pthread_key_create(&scratch_key, free_scratch) != 0) {
        PyErr_SetString(PyExc_OSError, "symbackprop_fastcall: no thread-local key");
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&CallerType);
    if (PyModule_AddObject(m, "Caller", (PyObject *)&CallerType) < 0) {
        Py_DECREF(&CallerType);
        Py_DECREF(m);
        return NULL;
    }
#ifdef SYMBACKPROP_FASTCALL_SOURCE
    /* built with the package (setup.py): the SHA-256 of this file, so that a
     * copy built from another version of it is not used (symbackprop.run.fastcall) */
    if (PyModule_AddStringConstant(m, "SOURCE_DIGEST", SYMBACKPROP_FASTCALL_SOURCE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#endif
    return m;
}
