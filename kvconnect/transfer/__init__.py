"""Moving rows between an engine's paged KV planes and flat chunk buffers.

- ``tables``: the framework-free description of a transfer (segments, slots, the plane table)
  and its one ``validate``;
- ``dispatch``: which route moves it (``gather``, ``scatter``, ``prepare``, ``backend_for``);
- the routes: ``kernels`` (the compiled CPU / CUDA kernels' loaders), ``cuda`` (the CUDA
  kernel's wrapper and tuning), ``triton_route`` + ``triton_staged`` + ``triton_launch`` +
  ``triton_kernels`` + ``staging`` (the Triton route: direct and through a device ring, what
  launching needs, its kernels, its per-device rings and streams),
  ``torch_impl`` (the reference implementation, and the fallback);
- ``placement``: which cores the CPU copy threads run on, beside the serving engine's.

The package imports the layout, the errors and the config, nothing of the engine, storage or
adapters.
"""
