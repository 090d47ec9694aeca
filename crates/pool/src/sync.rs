//! Locking that never skips work silently. A `std::sync::Mutex` is poisoned when a thread
//! panicked while holding it; `if let Ok(g) = m.lock()` then quietly skips the work (an engine
//! not registered, a connection not cached, a waiter not woken) for the rest of the process's
//! life. [`LockExt::locked`] takes the guard either way: the panic is already reported where it
//! happened, and each critical section in the crates that use this is one read, insert, remove
//! or replace of the guarded value, which leaves it consistent at every unlock.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// [`Mutex::lock`] that recovers the guard of a poisoned mutex.
pub trait LockExt<T: ?Sized> {
    /// The guard, poisoned or not.
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T: ?Sized> LockExt<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::LockExt;
    use std::sync::Mutex;

    #[test]
    fn a_poisoned_mutex_still_gives_its_value() {
        let m = std::sync::Arc::new(Mutex::new(vec![1]));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let _g = m2.lock().unwrap();
            panic!("poison it");
        })
        .join();
        assert!(m.is_poisoned());
        m.locked().push(2);
        assert_eq!(*m.locked(), vec![1, 2]);
    }
}
