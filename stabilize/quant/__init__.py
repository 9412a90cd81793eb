"""8- and 4-bit formats: their facts, their scales, fake quantization and headroom counts.

Pure torch (``formats``, ``scaling``, ``quantize``, ``headroom``) except ``ao``, the one module
that imports torchao, and only inside its functions: importing this package, or any 16-bit
path, never loads torchao. docs/design-formats.md says what torchao does and what is ours.
"""
