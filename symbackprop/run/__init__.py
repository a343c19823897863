"""The run stage: a built module called from Python.

    function.py     one C function: its binder and the call (Function, PreparedCall)
    module.py       CompiledModule: the functions of one model, built on first use
    derivatives.py  vjp, jvp, hvp, hessian, jacobian and check_grads of a CompiledModule
    gradcheck.py    the gradient check against central differences along random directions

symbackprop.run.runtime holds `compile` (generate, build or load from the
cache); interop and Dask sit on top.
"""
