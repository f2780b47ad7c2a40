"""Compiled kernels called by address from other compiled code.

numba compiles a call from one jitted function to another by linking the callee into the caller
and optimising the two together: the caller runs a second copy of the callee, compiled again in
another context (whose sums may round differently, as fresh and cached compiles of one kernel were
seen to), and every caller's compile repeats its callees' (a decode layer calling twenty kernels
took a minute). A `Kernel` is instead the address of one compiled specialisation's C entry point
(the cfunc wrapper numba builds for every jitted function), taken in Python; `call0` .. `call3`
jump to it. The caller then runs the very machine code a call from Python runs, and compiles in
seconds. A `Kernel` also holds a hash of the argument and return types it was compiled for, which
each call compares with its own (a mismatch raises, never passes wrong arguments).

Kernels called so should not raise: numba's C entry prints an exception it cannot pass on.
"""
from __future__ import annotations

import zlib
from typing import NamedTuple

from llvmlite import ir
from numba import types
from numba.core.errors import TypingError
from numba.extending import intrinsic, overload

F32_2D = types.Array(types.float32, 2, "C")  # the products' outputs


class Kernel(NamedTuple):
    """A compiled specialisation's C entry (``addr``) and the hash of its types (``sig``); any
    named tuple with these two fields is called the same way."""

    addr: int
    sig: int


NO_KERNEL = Kernel(0, 0)  # a stand-in where a call is never made (it would raise: no hash is 0)


def signature_hash(args: tuple, restype) -> int:
    """A hash of numba types, the same in every process."""
    return zlib.crc32(repr((str(restype), [str(a) for a in args])).encode()) | 1


def kernel(dispatcher, args: tuple) -> Kernel:
    """The `Kernel` of ``dispatcher`` compiled for the numba types ``args`` (compiling it if needed)."""
    args = tuple(args)
    dispatcher.compile(args)
    cres = dispatcher.overloads[args]
    addr = cres.library.get_pointer_to_function(cres.fndesc.llvm_cfunc_wrapper_name)
    return Kernel(int(addr), signature_hash(args, cres.signature.return_type))


def _invoker(restype):
    @intrinsic
    def invoke(typingctx, addr, args):
        if not isinstance(args, types.BaseTuple):
            return None

        def codegen(context, builder, signature, llargs):
            fnty = ir.FunctionType(context.get_value_type(restype),
                                   [context.get_value_type(t) for t in signature.args[1].types])
            fn = builder.inttoptr(llargs[0], fnty.as_pointer())
            out = builder.call(fn, [builder.extract_value(llargs[1], i) for i in range(len(args.types))])
            return context.get_dummy_value() if restype is types.none else out

        return restype(addr, args), codegen

    return invoke


_RETURNS = (types.none, F32_2D, types.UniTuple(F32_2D, 2), types.UniTuple(F32_2D, 3))
_INVOKE = tuple(_invoker(r) for r in _RETURNS)


def _call_overload(n: int):
    restype, invoke = _RETURNS[n], _INVOKE[n]

    def call(k, args):  # pragma: no cover - replaced by the overload in compiled code
        raise NotImplementedError

    @overload(call, inline="always", jit_options=dict(fastmath=False))
    def impl(k, args):
        if not isinstance(args, types.BaseTuple):
            raise TypingError("call: the arguments go in a tuple")
        h = signature_hash(tuple(args.types), restype)

        def checked(k, args):
            if k.sig != h:
                raise TypeError("a kernel was called with other argument types than it was compiled for")
            return invoke(k.addr, args)

        return checked

    call.__name__ = call.__qualname__ = f"call{n}"
    return call


call0 = _call_overload(0)  # returns nothing
call0.__doc__ = "``k(*args)`` for a kernel returning nothing (inside compiled code)."
call1 = _call_overload(1)
call1.__doc__ = "``k(*args)`` for a kernel returning a float32 C array ``[T, n]`` (inside compiled code)."
call2 = _call_overload(2)
call2.__doc__ = "``k(*args)`` for a kernel returning two float32 C arrays (inside compiled code)."
call3 = _call_overload(3)
call3.__doc__ = "``k(*args)`` for a kernel returning three float32 C arrays (inside compiled code)."

__all__ = ["F32_2D", "Kernel", "NO_KERNEL", "call0", "call1", "call2", "call3", "kernel", "signature_hash"]
