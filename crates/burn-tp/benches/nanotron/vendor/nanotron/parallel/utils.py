# Shim (burn-tp) of nanotron.parallel.utils.MemoryBuffer, on the CPU: nanotron's allocates on
# torch.cuda.current_device(); otherwise the same (one reused buffer per name and dtype).
import functools
import operator

import torch


class MemoryBuffer:
    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
            cls._instance.buffer = {}
        return cls._instance

    def get(self, name, shape, dtype=torch.bfloat16):
        required_numel = functools.reduce(operator.mul, shape, 1)
        if (name, dtype) not in self.buffer or self.buffer[name, dtype].numel() < required_numel:
            self.buffer[name, dtype] = torch.empty(required_numel, dtype=dtype, requires_grad=False)
        return self.buffer[name, dtype][:required_numel].view(shape)
