//! dump.
