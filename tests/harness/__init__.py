"""Test-side helpers, imported as ``harness.<module>`` (``tests/`` is on ``sys.path``): real runs in
subprocesses (``multiproc``), the layouts that tests/integration/parallel/ trains once per session
(``layouts``), worlds of ranks (``distributed``), injected faults (``faults``, ``exit_faults``,
``disk_faults``), the data-loader tests' data sets and batches (``batches``), the tiny model config
(``models``), attention backends against sdpa (``backend_checks``), the CPU stand-ins of flash-attn and
FlashAttention-4 (``flash_standin``, ``flash4_standin``) and FA4's compile check (``fa4_compile``,
``fa4_interface``), usage errors on the command line (``user_errors``), and a local Slurm
(``slurm_harness``)."""
