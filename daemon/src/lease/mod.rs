//! lease
