// Exceptions thrown for bad input. Messages name the entry point, the argument and what
// was expected; the PyTorch layer maps them to Python's ValueError, TypeError,
// NotImplementedError and torch.OutOfMemoryError.
#pragma once

#include <stdexcept>
#include <string>

namespace vidattn {

// A value, shape, stride, device or option that the entry point cannot accept.
class ValueError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A dtype that the entry point cannot accept.
class TypeError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A valid request this build cannot serve (e.g. a CUDA tensor in a CPU-only build).
class NotImplementedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Memory the entry point needs for its working copies and cannot get (the CPU backend's
// packed inputs, named in the message); the PyTorch layer raises torch.OutOfMemoryError.
class OutOfMemoryError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace vidattn
