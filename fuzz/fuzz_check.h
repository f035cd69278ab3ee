#pragma once

// Shared by the libFuzzer harnesses (docs/fuzzing.md). A harness lets sinew::Error through
// as the expected way to reject an input; anything else is a finding: another exception
// type escapes LLVMFuzzerTestOneInput (libFuzzer reports it as a crash), a sanitizer
// report, or a broken property checked with SINEW_FUZZ_CHECK.

#include <cstdio>
#include <cstdlib>

// Aborts (a libFuzzer crash, with the input saved) when a property of a parsed value
// does not hold.
#define SINEW_FUZZ_CHECK(cond, ...)                                                              \
  do {                                                                                           \
    if (!(cond)) {                                                                               \
      std::fprintf(stderr, "SINEW_FUZZ_CHECK failed at %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                                         \
      std::fprintf(stderr, "\n");                                                                \
      std::abort();                                                                              \
    }                                                                                            \
  } while (0)
