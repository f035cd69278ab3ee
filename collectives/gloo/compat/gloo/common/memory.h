#pragma once

// Stands in for Gloo's gloo/common/memory.h where the installed Gloo lacks it: Debian 12's
// libgloo-dev (0.0~git20220518) ships gloo/transport/tcp/pair.h and context.h, which include
// it, without it. Only gloo/pair_mesh.cc includes those headers, and only for the layout of
// Gloo's tcp::Pair and tcp::Context (it calls none of these classes' members); the classes
// below therefore hold exactly what Gloo's do, one std::shared_ptr or std::weak_ptr each, so
// that the pairs' layout matches the library's. The build adds this directory to the include
// path only when the header is missing (collectives/CMakeLists.txt).
//
// What they are in Gloo: ShareableNonOwningPtr is an object's root reference to itself,
// whose destruction waits until no NonOwningPtr to the object is left; WeakNonOwningPtr is
// a weak reference handed out from it; NonOwningPtr is a short-lived strong reference made
// from a weak one while the object lives.

#include <memory>
#include <thread>

namespace gloo {

template <typename T>
class WeakNonOwningPtr;

template <typename T>
class ShareableNonOwningPtr final {
 public:
  explicit ShareableNonOwningPtr(T* object) : ptr_(object, [](T*) {}) {}
  ShareableNonOwningPtr(const ShareableNonOwningPtr&) = delete;
  ShareableNonOwningPtr& operator=(const ShareableNonOwningPtr&) = delete;
  ~ShareableNonOwningPtr() {
    std::weak_ptr<T> watch(ptr_);
    ptr_.reset();
    while (!watch.expired()) std::this_thread::yield();
  }

 private:
  std::shared_ptr<T> ptr_;
  friend class WeakNonOwningPtr<T>;
};

template <typename T>
class NonOwningPtr;

template <typename T>
class WeakNonOwningPtr final {
 public:
  WeakNonOwningPtr() = default;
  explicit WeakNonOwningPtr(const ShareableNonOwningPtr<T>& root) : ptr_(root.ptr_) {}
  // Whether it was made from a root (even one that is gone now).
  explicit operator bool() const noexcept {
    const std::weak_ptr<T> empty;
    return ptr_.owner_before(empty) || empty.owner_before(ptr_);
  }

 private:
  std::weak_ptr<T> ptr_;
  friend class NonOwningPtr<T>;
};

template <typename T>
class NonOwningPtr final {
 public:
  NonOwningPtr() = default;
  explicit NonOwningPtr(const WeakNonOwningPtr<T>& weak) : ptr_(weak.ptr_.lock()) {}
  T* operator->() const noexcept { return ptr_.get(); }
  explicit operator bool() const noexcept { return static_cast<bool>(ptr_); }

 private:
  std::shared_ptr<T> ptr_;
};

}  // namespace gloo
