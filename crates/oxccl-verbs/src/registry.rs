//! The registry: which module implements each [`Provider`], the devices this build offers, and
//! opening a context on one.
//!
//! It sits at the top of the crate, above the providers, because it names them: the model only
//! knows a provider's identity ([`Provider`]), the contract only the traits a provider
//! implements. Adding a provider is one variant of [`Provider`] (`model::endpoint`) and one
//! line in [`Provider::open`] below (the match is exhaustive: a variant without a line does not
//! compile); see `contract` for the rest of the implementer's guide.

use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::{Arc, Mutex};

use crate::contract::{CtxInner, KeyRng, OpenArgs, ProviderContext, RegionMap, Tables, Tuning};
use crate::model::{DeviceConfig, Provider, Result};
use crate::resource::{Context, host_identity};

impl Provider {
    /// Opens the provider's half of a new context.
    pub(crate) fn open(self, args: &OpenArgs<'_>) -> Result<Box<dyn ProviderContext>> {
        match self {
            Provider::Shm => crate::shm::open(args),
            Provider::Tcp => crate::tcp::open(args),
            Provider::Ofi => crate::ofi::open(args),
        }
    }
}

/// A verbs device: a provider that can be opened (`ibv_device`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Device {
    provider: Provider,
}

impl Device {
    /// Every device this build offers, one per provider.
    pub fn list() -> Vec<Device> {
        Provider::ALL
            .iter()
            .map(|&provider| Device { provider })
            .collect()
    }

    /// The device of the named provider (`"shm"`).
    pub fn by_name(name: &str) -> Result<Device> {
        Ok(Device {
            provider: name.parse()?,
        })
    }

    /// The provider behind this device.
    pub fn provider(&self) -> Provider {
        self.provider
    }

    /// Opens a context on this device (`ibv_open_device`), configured from the environment
    /// ([`DeviceConfig::from_env`]).
    pub fn open(&self) -> Result<Context> {
        Context::open_with(self.provider, &DeviceConfig::from_env()?)
    }

    /// Opens a context on this device with the given configuration.
    pub fn open_with(&self, config: &DeviceConfig) -> Result<Context> {
        Context::open_with(self.provider, config)
    }
}

impl Context {
    /// Opens a context for `provider` (same as `Device { provider }.open()`), configured from
    /// the environment ([`DeviceConfig::from_env`]: a convenience for tools and tests; a library
    /// that has its own configuration calls [`Context::open_with`]).
    pub fn open(provider: Provider) -> Result<Context> {
        Context::open_with(provider, &DeviceConfig::from_env()?)
    }

    /// Opens a context for `provider` with the given configuration.
    pub fn open_with(provider: Provider, config: &DeviceConfig) -> Result<Context> {
        let seg = CtxInner::create_segment()?;
        let regions = RegionMap::default();
        let keys = KeyRng::from_os()?;
        let ops = provider.open(&OpenArgs {
            config,
            seg: &seg,
            regions: &regions,
            keys: &keys,
        })?;
        Ok(Context {
            inner: Arc::new(CtxInner {
                provider,
                seg,
                pid: std::process::id(),
                host: host_identity(),
                tuning: Tuning { spin: config.spin },
                regions,
                tables: Mutex::new(Tables::new()),
                next_qpn: AtomicU32::new(1),
                next_pd: AtomicU64::new(1),
                keys,
                ops,
            }),
        })
    }
}
