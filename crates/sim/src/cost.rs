//! What GPU time costs, from the billing crate's price book — the same
//! prices the server rates usage with — rather than a table of the
//! simulator's own. Money is `Decimal`, rounded to cents only for display.

use flotilla_billing::price::{list_price_book, PriceVersion};
use flotilla_core::catalog::Catalog;
use rust_decimal::Decimal;

use crate::SimError;

/// Per-GPU-second prices of one GPU type, from one price version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pricing {
    /// The price version the prices come from.
    pub version: u32,
    /// ISO code of the currency.
    pub currency: String,
    /// On-demand price of one GPU-second.
    pub on_demand_per_gpu_second: Decimal,
    /// Spot price of one GPU-second: the band's floor, as the server rates
    /// spot until it records a price series from pool utilisation (the
    /// on-demand price where the version has no band for the type).
    pub spot_per_gpu_second: Decimal,
    /// Price of one GB-second of host memory held by a parked replica.
    pub parked_per_gb_second: Decimal,
}

const MS_PER_S: i64 = 1_000;

impl Pricing {
    /// The prices of `gpu` in `version`; an error when it has none.
    pub fn from_version(version: &PriceVersion, gpu: &str) -> Result<Self, SimError> {
        let on_demand = version
            .on_demand(gpu)
            .map_err(|source| SimError::Pricing { source })?
            .per_gpu_second;
        let spot = version.spot.get(gpu).map_or(on_demand, |band| band.floor);
        Ok(Self {
            version: version.version,
            currency: version.currency.code.clone(),
            on_demand_per_gpu_second: on_demand,
            spot_per_gpu_second: spot,
            parked_per_gb_second: version.parked_per_gb_second(),
        })
    }

    /// The prices of `gpu` in the list-price book of the built-in catalog
    /// (the server's default book).
    pub fn list(gpu: &str) -> Result<Self, SimError> {
        let book =
            list_price_book(&Catalog::default()).map_err(|source| SimError::Pricing { source })?;
        Self::from_version(book.latest(), gpu)
    }

    /// Cost of `gpu_ms` GPU-milliseconds on demand, to the cent.
    pub fn on_demand(&self, gpu_ms: u64) -> Decimal {
        (Decimal::from(gpu_ms) * self.on_demand_per_gpu_second / Decimal::from(MS_PER_S))
            .round_dp(2)
    }

    /// Cost of `replica_ms` replica-milliseconds parked, each holding
    /// `model_gb` GB of host memory, to the cent (a size that is not a
    /// finite number costs nothing rather than panicking).
    pub fn parked(&self, replica_ms: u64, model_gb: f64) -> Decimal {
        let gb = Decimal::try_from(model_gb).unwrap_or(Decimal::ZERO);
        (Decimal::from(replica_ms) * gb * self.parked_per_gb_second / Decimal::from(MS_PER_S))
            .round_dp(2)
    }

    /// Cost of node time: `on_demand_ms` and `spot_ms` GPU-milliseconds, to
    /// the cent.
    pub fn nodes(&self, on_demand_ms: u64, spot_ms: u64) -> Decimal {
        ((Decimal::from(on_demand_ms) * self.on_demand_per_gpu_second
            + Decimal::from(spot_ms) * self.spot_per_gpu_second)
            / Decimal::from(MS_PER_S))
        .round_dp(2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_prices_are_the_catalog_price_per_second() {
        let p = Pricing::list("H100").unwrap();
        let h100 = Catalog::default().get("H100").unwrap().list_price_per_hour;
        // One GPU-hour costs the list price; spot at the band's floor (30 %).
        assert_eq!(p.on_demand(3_600_000), h100.round_dp(2));
        assert_eq!(
            p.nodes(0, 3_600_000),
            (h100 * Decimal::new(3, 1)).round_dp(2)
        );
        assert_eq!(p.currency, "USD");
        // 16 GB parked for an hour at the list memory price.
        assert_eq!(
            p.parked(3_600_000, 16.0),
            (Decimal::from(16) * flotilla_billing::price::LIST_PARKED_GB_HOUR).round_dp(2)
        );
        assert_eq!(p.parked(3_600_000, f64::NAN), Decimal::ZERO);
    }

    #[test]
    fn an_unpriced_gpu_is_an_error() {
        assert!(matches!(
            Pricing::list("no-such-gpu"),
            Err(SimError::Pricing { .. })
        ));
    }
}
