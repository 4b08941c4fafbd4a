//! Arbitrary bytes decoded as a `CreateLeaseRequest` and run through the daemon's
//! request validation and planning: no panic, and every refusal is an
//! InvalidArgument naming a known field with a short message.
//!
//! Run: `cargo +nightly fuzz run create_lease_request` (from the repository root).
//! The same check runs in CI as a proptest: integration-tests/tests/validation_props.rs.

#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_integration_tests::validation::check_create_request_bytes;

fuzz_target!(|data: &[u8]| {
    if let Err(broken) = check_create_request_bytes(data) {
        panic!("{broken}");
    }
});
