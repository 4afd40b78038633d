// A library's kernel registry: for each kernel its name, its signature (one character per parameter,
// derived from the declaration in kernels.h), its address and an invoker that calls it with its
// arguments read from an int64 array (the replay's encoding). Python reads the registry at load
// (kernels/_abi.py) and sets each function's ctypes argument types from the signature; kernels are
// looked up by name, so no list elsewhere has to follow the order here.
//
// Signature characters: i int, l int64_t, f float, p pointer to const, w pointer to mutable.
// Encoding of one argument in an int64: integers and addresses as themselves, a float as its 32 bits
// in the low half.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "kernels.h"

namespace hs_registry {

template <typename T> constexpr char code() {
  if constexpr (std::is_same_v<T, int>) return 'i';
  else if constexpr (std::is_same_v<T, int64_t>) return 'l';
  else if constexpr (std::is_same_v<T, float>) return 'f';
  else if constexpr (std::is_pointer_v<T> && std::is_const_v<std::remove_pointer_t<T>>) return 'p';
  else if constexpr (std::is_pointer_v<T>) return 'w';
  else static_assert(sizeof(T) == 0, "a kernel parameter must be int, int64_t, float or a pointer");
}

template <typename T> T decode(int64_t v) {
  if constexpr (std::is_same_v<T, float>) {
    const uint32_t bits = static_cast<uint32_t>(v);
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  } else if constexpr (std::is_pointer_v<T>) {
    return reinterpret_cast<T>(static_cast<intptr_t>(v));
  } else {
    return static_cast<T>(v);
  }
}

template <typename F> struct Signature;

template <typename... Ts> struct Signature<int(Ts...)> {
  static constexpr char chars[] = {code<Ts>()..., '\0'};
  template <std::size_t... I>
  static int call(const void* fn, const int64_t* args, std::index_sequence<I...>) {
    return reinterpret_cast<int (*)(Ts...)>(const_cast<void*>(fn))(decode<Ts>(args[I])...);
  }
  static int invoke(const void* fn, const int64_t* args) { return call(fn, args, std::index_sequence_for<Ts...>{}); }
};

using Invoker = int (*)(const void* fn, const int64_t* args);

struct Entry {
  const char* name;
  const char* signature;
  const void* address;
  Invoker invoke;
};

}  // namespace hs_registry

#define HS_KERNEL(fn)                                                                   \
  hs_registry::Entry{#fn, hs_registry::Signature<decltype(fn)>::chars,                  \
                     reinterpret_cast<const void*>(&fn), &hs_registry::Signature<decltype(fn)>::invoke},

// Defines the library's registry over the kernels listed (each as HS_KERNEL(name)).
#define HS_REGISTRY(...)                                                                          \
  namespace {                                                                                     \
  const hs_registry::Entry kRegistry[] = {__VA_ARGS__};                                           \
  }                                                                                               \
  extern "C" int hs_registry_size() { return static_cast<int>(sizeof kRegistry / sizeof kRegistry[0]); } \
  extern "C" int hs_registry_entry(int i, const char** name, const char** signature, const void** address, \
                                   const void** invoker) {                                        \
    if (i < 0 || i >= hs_registry_size()) return 1;                                               \
    *name = kRegistry[i].name;                                                                    \
    *signature = kRegistry[i].signature;                                                          \
    *address = kRegistry[i].address;                                                              \
    *invoker = reinterpret_cast<const void*>(kRegistry[i].invoke);                                \
    return 0;                                                                                     \
  }
